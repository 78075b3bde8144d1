// The issue orders of the built-in schedules, as compute actions (forward,
// backward, weight). The builder in schedule.cpp adds the copies around them
// and resolves every dependency, so these only decide the order.
#pragma once

#include <vector>

#include "schedule.h"

namespace mpstream {

// Interleaves per-lane sequences (what one stage, or one rank of several
// stages, computes, in its order) into the single order one host thread
// issues, by simulating them with unit costs. Throws std::logic_error when
// the lanes wait on each other.
std::vector<Action> merge(const Layout& layout, const std::vector<std::vector<Action>>& lanes);

// Interleaved 1F1B's forwards and backwards per rank (see interleaved_order);
// `name` is the schedule named in errors.
std::vector<std::vector<Action>> interleaved_lanes(const Layout& layout, const char* name);

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

// The schedules of several stages per rank (orders_v.cpp). ZB-V and
// DualPipe-V place 2p stages on p ranks in a V (stage s on rank
// min(s, 2p - 1 - s)) and need virtual_stages == 2; interleaved zero-bubble
// and looped BFS place them round-robin, as interleaved 1F1B does.
std::vector<Action> zbv_order(const Layout& layout);
std::vector<Action> dualpipev_order(const Layout& layout);
std::vector<Action> interleaved_zb_order(const Layout& layout);
std::vector<Action> looped_bfs_order(const Layout& layout);

}  // namespace mpstream
