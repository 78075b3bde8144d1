// The issue orders of the built-in schedules, as compute actions (forward,
// backward, weight). The builder in schedule.cpp adds the copies around them
// and resolves every dependency, so these only decide the order.
#pragma once

#include <vector>

#include "schedule.h"

namespace mpstream {

// Fill-drain in clock cycles: at cycle k stage s forwards micro-batch k - s;
// with `backward`, the backwards mirror it once every forward is issued.
std::vector<Action> gpipe_order(const Layout& layout, bool backward);

// 1F1B: stage s runs min(stages - s - 1, micros) warm-up forwards, then
// alternates a forward and a backward, then drains.
std::vector<Action> one_f_one_b_order(const Layout& layout);

// Megatron-LM's interleaved 1F1B over ranks of `virtual_stages` stages.
std::vector<Action> interleaved_order(const Layout& layout);

// Zero-bubble H1: 1F1B with every backward split into B and W, and W
// passes deferred into the time 1F1B leaves idle.
std::vector<Action> zb_h1_order(const Layout& layout);

}  // namespace mpstream
