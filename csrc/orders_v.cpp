// Issue orders of the built-in schedules that put several stages on each
// rank: ZB-V and DualPipe-V (two stages per rank in a V), interleaved
// zero-bubble and looped breadth-first (stages round-robin over the ranks).
// As in orders.cpp, each is a sequence of actions per rank, turned into one
// issue order by merge(); the rules come from the schedules' published
// descriptions, each stated where it is built.
#include <algorithm>
#include <deque>
#include <functional>
#include <stdexcept>
#include <string>

#include "orders.h"

namespace mpstream {

namespace {

// The number of ranks p of a V placement: 2p stages, stage s and
// 2p - 1 - s on rank s, so rank r holds chunk 0 (stage r, on the way down)
// and chunk 1 (stage 2p - 1 - r, on the way back).
int32_t v_ranks(const Layout& l, const char* name) {
  if (l.virtual_stages != 2 || l.stages % 2 != 0) {
    throw std::invalid_argument(
        std::string(name) + " places two stages per rank in a V (stages s and 2p - 1 - s on "
        "rank s): it needs an even number of stages and virtual_stages=2, got " +
        std::to_string(l.stages) + " stages and virtual_stages=" +
        std::to_string(l.virtual_stages));
  }
  return l.stages / 2;
}

int32_t v_stage(int32_t p, int32_t r, int32_t chunk) {
  return chunk == 0 ? r : 2 * p - 1 - r;
}

// One rank's sequence of a V schedule for `micros` micro-batches.
using RankLane = std::function<std::vector<Action>(int32_t p, int32_t r, int32_t micros)>;

// The lanes of a V schedule whose phases need at least `minimum`
// micro-batches: fewer are padded up to it and the padding's actions
// dropped, which keeps every remaining action after what it depends on
// (dropping an action only drops dependencies), so the order stays
// deadlock-free and holds no more in flight.
std::vector<std::vector<Action>> padded_lanes(const Layout& l, int32_t p, int32_t minimum,
                                              const RankLane& lane_of) {
  const int32_t micros = std::max(l.micros, minimum);
  std::vector<std::vector<Action>> lanes(p);
  for (int32_t r = 0; r < p; ++r) {
    for (const Action& a : lane_of(p, r, micros)) {
      if (a.micro < l.micros) {
        lanes[r].push_back(a);
      }
    }
  }
  return lanes;
}

// Counters of one rank's two chunks: the next forward, backward and weight
// pass of each, micro-batches taken in order.
struct VLane {
  int32_t p;
  int32_t r;
  std::vector<Action> actions;
  int32_t next[3][2] = {{0, 0}, {0, 0}, {0, 0}};  // [F, B, W][chunk]

  void add(Kind k, int32_t chunk) {
    const int slot = k == Kind::kForward ? 0 : k == Kind::kBackward ? 1 : 2;
    actions.push_back({k, v_stage(p, r, chunk), next[slot][chunk]++});
  }
  int32_t count(Kind k, int32_t chunk) const {
    return next[k == Kind::kForward ? 0 : k == Kind::kBackward ? 1 : 2][chunk];
  }
};

// ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024).
// With equal unit costs, micro-batch 0 reaches rank r at time r and comes
// back to it (chunk 1) at 2p - 1 - r, so the rank first fills that gap
// with 2(p - r) - 1 chunk-0 forwards; its first gradient arrives r steps
// after micro-batch 0 turned back, gaps filled by alternating chunk-1 and
// chunk-0 forwards. It then runs p - r rounds of a chunk-1 forward, B and
// W, and in the steady state one forward, B and W of each chunk per round;
// the cool-down runs the remaining Bs first, deferring their Ws into the
// time the last gradients take to arrive.
std::vector<Action> zbv_lane(int32_t p, int32_t r, int32_t micros) {
  VLane lane{p, r, {}};
  for (int32_t i = 0; i < 2 * (p - r) - 1; ++i) {
    lane.add(Kind::kForward, 0);
  }
  for (int32_t i = 0; i < r; ++i) {
    lane.add(Kind::kForward, 1);
    lane.add(Kind::kForward, 0);
  }
  for (int32_t i = 0; i < p - r; ++i) {
    lane.add(Kind::kForward, 1);
    lane.add(Kind::kBackward, 1);
    lane.add(Kind::kWeight, 1);
  }
  while (lane.count(Kind::kForward, 1) < lane.count(Kind::kForward, 0) ||
         lane.count(Kind::kForward, 0) < micros) {
    if (lane.count(Kind::kForward, 0) < micros) {
      lane.add(Kind::kForward, 0);
    }
    lane.add(Kind::kBackward, 0);
    lane.add(Kind::kWeight, 0);
    lane.add(Kind::kForward, 1);
    lane.add(Kind::kBackward, 1);
    lane.add(Kind::kWeight, 1);
  }
  for (int32_t i = 0; i < r; ++i) {
    lane.add(Kind::kBackward, 0);
    lane.add(Kind::kBackward, 1);
  }
  for (int32_t i = 0; i < p - r; ++i) {
    lane.add(Kind::kBackward, 0);
    lane.add(Kind::kWeight, 0);
  }
  for (int32_t c : {1, 0}) {
    while (lane.count(Kind::kWeight, c) < lane.count(Kind::kBackward, c)) {
      lane.add(Kind::kWeight, c);
    }
  }
  return lane.actions;
}

// DualPipe-V (DeepSeek's DualPipe "cut in half": one V instead of two
// pipelines running in opposite directions). Rank r's phases, after the
// published description: 2(p - r - 1) chunk-0 forwards; r + 1 pairs of a
// chunk-0 and a chunk-1 forward; p - r - 1 rounds of a split chunk-1
// backward, its W and a chunk-1 forward; the main phase of m - 2p + r + 1
// rounds, each a chunk-0 forward paired with a chunk-1 backward and a
// chunk-1 forward paired with a chunk-0 backward (full backwards: the pair
// overlaps them on the rank's two streams); p - r - 1 rounds of a chunk-1
// backward then a chunk-1 forward paired with a chunk-0 backward; r + 1
// rounds of a chunk-1 and a chunk-0 backward, from half-way through split
// into B and W (an odd rank from its chunk-1 backward of that round, an even
// one from the chunk-0 one); p - r - 1 rounds of a W then a split chunk-0
// backward; and the r + 1 remaining Ws. Ws run in the order of their Bs.
// The main phase needs m >= 2p.
std::vector<Action> dualpipev_lane(int32_t p, int32_t r, int32_t micros) {
  VLane lane{p, r, {}};
  std::deque<Action> weights;  // split backwards waiting for their W
  const auto backward = [&](int32_t chunk, bool split) {
    lane.add(Kind::kBackward, chunk);
    if (split) {
      weights.push_back({Kind::kWeight, lane.actions.back().stage, lane.actions.back().micro});
    }
  };
  const auto weight = [&] {
    lane.actions.push_back(weights.front());
    weights.pop_front();
  };
  for (int32_t i = 0; i < 2 * (p - r - 1); ++i) {
    lane.add(Kind::kForward, 0);
  }
  for (int32_t i = 0; i < r + 1; ++i) {
    lane.add(Kind::kForward, 0);
    lane.add(Kind::kForward, 1);
  }
  for (int32_t i = 0; i < p - r - 1; ++i) {
    backward(1, true);
    weight();
    lane.add(Kind::kForward, 1);
  }
  for (int32_t i = 0; i < micros - 2 * p + r + 1; ++i) {
    lane.add(Kind::kForward, 0);
    backward(1, false);
    lane.add(Kind::kForward, 1);
    backward(0, false);
  }
  for (int32_t i = 0; i < p - r - 1; ++i) {
    backward(1, false);
    lane.add(Kind::kForward, 1);
    backward(0, false);
  }
  bool split = false;
  const int32_t half = (r + 1) / 2;
  for (int32_t i = 0; i < r + 1; ++i) {
    split = split || (i == half && r % 2 == 1);
    backward(1, split);
    split = split || (i == half && r % 2 == 0);
    backward(0, split);
  }
  for (int32_t i = 0; i < p - r - 1; ++i) {
    weight();
    backward(0, true);
  }
  while (!weights.empty()) {
    weight();
  }
  return lane.actions;
}

std::vector<std::vector<int32_t>> readers_of(const Layout& l) {
  std::vector<std::vector<int32_t>> readers(l.stages);
  for (int32_t q = 0; q < l.stages; ++q) {
    for (int32_t p : l.reads[q]) {
      if (p >= 0) {
        readers[p].push_back(q);
      }
    }
  }
  return readers;
}

// Splits every backward of `lanes` into B and W and places the Ws, in unit
// time (F, B and W one unit each): a lane runs its next forward or B as
// soon as what it depends on has ended; while it waits, it runs its oldest
// deferred W instead; and it never holds more than caps[lane] Ws deferred
// (beyond that, a W runs right after its B). Ws thus fill the time the
// lane would idle, and what waits for them stays bounded.
std::vector<std::vector<Action>> fill_weights(const Layout& l,
                                              const std::vector<std::vector<Action>>& lanes,
                                              const std::vector<int32_t>& caps) {
  const auto readers = readers_of(l);
  // End times of forwards and Bs per stage and micro-batch; -1 while pending.
  std::vector<std::vector<int64_t>> forward(l.stages, std::vector<int64_t>(l.micros, -1));
  std::vector<std::vector<int64_t>> input(l.stages, std::vector<int64_t>(l.micros, -1));
  const auto ended = [](int64_t e, int64_t now) { return e >= 0 && e <= now; };
  const auto ready = [&](const Action& a, int64_t now) {
    if (a.kind == Kind::kForward) {
      return std::all_of(l.reads[a.stage].begin(), l.reads[a.stage].end(), [&](int32_t p) {
        return p < 0 || ended(forward[p][a.micro], now);
      });
    }
    return ended(forward[a.stage][a.micro], now) &&
           std::all_of(readers[a.stage].begin(), readers[a.stage].end(),
                       [&](int32_t q) { return ended(input[q][a.micro], now); });
  };
  std::vector<std::vector<Action>> out(lanes.size());
  std::vector<std::deque<Action>> deferred(lanes.size());
  std::vector<size_t> next(lanes.size(), 0);
  size_t remaining = 0;  // actions to place, a W per backward included
  for (const auto& lane : lanes) {
    for (const Action& a : lane) {
      remaining += a.kind == Kind::kBackward ? 2 : 1;
    }
  }
  for (int64_t now = 0; remaining > 0; ++now) {
    bool started = false;
    for (size_t i = 0; i < lanes.size(); ++i) {
      const bool runnable = next[i] < lanes[i].size() && ready(lanes[i][next[i]], now);
      Action a;
      if (!deferred[i].empty() &&
          (static_cast<int32_t>(deferred[i].size()) > caps[i] || !runnable)) {
        a = deferred[i].front();
        deferred[i].pop_front();
      } else if (runnable) {
        a = lanes[i][next[i]++];
        (a.kind == Kind::kForward ? forward : input)[a.stage][a.micro] = now + 1;
        if (a.kind == Kind::kBackward) {
          deferred[i].push_back({Kind::kWeight, a.stage, a.micro});
        }
      } else {
        continue;
      }
      out[i].push_back(a);
      --remaining;
      started = true;
    }
    // Whatever started earlier has ended by now: if nothing can start, the
    // lanes wait on each other for good.
    if (!started) {
      throw std::logic_error("the lanes of a schedule wait on each other (deadlock)");
    }
  }
  return out;
}

}  // namespace

std::vector<Action> zbv_order(const Layout& l) {
  const int32_t p = v_ranks(l, "zbv");
  return merge(l, padded_lanes(l, p, 2 * p, zbv_lane));
}

std::vector<Action> dualpipev_order(const Layout& l) {
  const int32_t p = v_ranks(l, "dualpipev");
  return merge(l, padded_lanes(l, p, 2 * p, dualpipev_lane));
}

// Interleaved zero-bubble: interleaved 1F1B's placement, forwards and
// backwards, each backward split into B and W, and the Ws deferred into the
// time the rank would wait (fill_weights). Rank r defers at most r Ws, as
// zero-bubble H1's stage s defers s: rank r finishes its last B about r
// steps before rank 0 does, which the deferred Ws fill.
std::vector<Action> interleaved_zb_order(const Layout& l) {
  const auto lanes = interleaved_lanes(l, "interleaved_zb");
  std::vector<int32_t> caps(lanes.size());
  for (size_t r = 0; r < caps.size(); ++r) {
    caps[r] = static_cast<int32_t>(r);
  }
  return merge(l, fill_weights(l, lanes, caps));
}

// Looped breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
// 2022): stages round-robin over p ranks as in interleaved 1F1B, but each
// rank forwards every micro-batch through one of its stages before the
// next, then back-propagates them stage by stage in reverse (the freshest
// micro-batch first, as fill-drain does). Every micro-batch's activations
// stay alive until its backward, as in fill-drain.
std::vector<Action> looped_bfs_order(const Layout& l) {
  const int32_t v = l.virtual_stages;
  if (v < 1 || l.stages % v != 0) {
    throw std::invalid_argument(
        "looped_bfs: " + std::to_string(l.stages) + " stages do not form ranks of " +
        std::to_string(v) + " virtual stages each (stages must be a multiple of virtual_stages)");
  }
  const int32_t p = l.stages / v;
  std::vector<std::vector<Action>> lanes(p);
  for (int32_t r = 0; r < p; ++r) {
    for (int32_t c = 0; c < v; ++c) {
      for (int32_t m = 0; m < l.micros; ++m) {
        lanes[r].push_back({Kind::kForward, c * p + r, m});
      }
    }
    for (int32_t c = v - 1; c >= 0; --c) {
      for (int32_t m = l.micros - 1; m >= 0; --m) {
        lanes[r].push_back({Kind::kBackward, c * p + r, m});
      }
    }
  }
  return merge(l, lanes);
}

}  // namespace mpstream
