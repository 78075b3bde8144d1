// Issue orders: those of the built-in schedules, and the check of explicit
// ones. Each pipelined schedule is first a sequence of actions per lane
// (what one stage, or one rank of interleaved stages, computes, in its
// order); merge() turns the lanes into the single order one host thread
// issues.
#include "orders.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace mpstream {

namespace {

int kind_slot(Kind k) {
  return k == Kind::kForward ? 0 : k == Kind::kBackward ? 1 : 2;
}

}  // namespace

// Interleaves per-lane sequences into one issue order by simulating them:
// forwards, split backwards (B) and weight passes (W) cost one unit, a
// backward that is not split two; each lane runs its actions one at a time,
// each once the actions it depends on over the stage graph have ended. The
// order sorts actions by simulated start, which is a topological order
// because an action starts only after its dependencies end.
std::vector<Action> merge(const Layout& l, const std::vector<std::vector<Action>>& lanes) {
  const auto stages = static_cast<size_t>(l.stages);
  const auto micros = static_cast<size_t>(l.micros);
  std::vector<std::vector<int32_t>> readers(stages);
  for (int32_t q = 0; q < l.stages; ++q) {
    for (int32_t p : l.reads[q]) {
      if (p >= 0) {
        readers[p].push_back(q);
      }
    }
  }
  std::vector<std::vector<bool>> split(stages, std::vector<bool>(micros, false));
  for (const auto& lane : lanes) {
    for (const Action& a : lane) {
      if (a.kind == Kind::kWeight) {
        split[a.stage][a.micro] = true;
      }
    }
  }
  // End times per kind (F, B, W), stage and micro-batch; -1 while pending.
  std::array<std::vector<std::vector<int64_t>>, 3> end;
  for (auto& e : end) {
    e.assign(stages, std::vector<int64_t>(micros, -1));
  }
  struct Timed {
    Action action;
    int64_t start;
  };
  std::vector<Timed> timed;
  std::vector<size_t> next(lanes.size(), 0);
  std::vector<int64_t> free_at(lanes.size(), 0);
  size_t remaining = 0;
  for (const auto& lane : lanes) {
    remaining += lane.size();
  }
  while (remaining > 0) {
    bool progressed = false;
    for (size_t lane = 0; lane < lanes.size(); ++lane) {
      if (next[lane] >= lanes[lane].size()) {
        continue;
      }
      const Action a = lanes[lane][next[lane]];
      const int32_t s = a.stage;
      const int32_t m = a.micro;
      int64_t ready = free_at[lane];
      bool blocked = false;
      const auto after = [&](Kind k, int32_t stage) {
        const int64_t e = end[kind_slot(k)][stage][m];
        blocked = blocked || e < 0;
        ready = std::max(ready, e);
      };
      if (a.kind == Kind::kForward) {
        for (int32_t p : l.reads[s]) {
          if (p >= 0) {
            after(Kind::kForward, p);
          }
        }
      } else if (a.kind == Kind::kBackward) {
        after(Kind::kForward, s);
        for (int32_t q : readers[s]) {
          after(Kind::kBackward, q);
        }
      } else {
        after(Kind::kBackward, s);
      }
      if (blocked) {
        continue;
      }
      const int64_t cost = a.kind == Kind::kBackward && !split[s][m] ? 2 : 1;
      end[kind_slot(a.kind)][s][m] = ready + cost;
      free_at[lane] = ready + cost;
      timed.push_back({a, ready});
      ++next[lane];
      --remaining;
      progressed = true;
    }
    if (!progressed) {
      throw std::logic_error("the lanes of a schedule wait on each other (deadlock)");
    }
  }
  std::stable_sort(timed.begin(), timed.end(),
                   [](const Timed& x, const Timed& y) { return x.start < y.start; });
  std::vector<Action> order;
  order.reserve(timed.size());
  for (const Timed& t : timed) {
    order.push_back(t.action);
  }
  return order;
}

std::vector<Action> gpipe_order(const Layout& l, bool backward) {
  std::vector<Action> order;
  for (int32_t k = 0; k < l.micros + l.stages - 1; ++k) {
    for (int32_t s = 0; s < l.stages; ++s) {
      const int32_t m = k - s;
      if (m >= 0 && m < l.micros) {
        order.push_back({Kind::kForward, s, m});
      }
    }
  }
  if (backward) {
    // The last stage starts with the last micro-batch, the freshest.
    for (int32_t k = 0; k < l.micros + l.stages - 1; ++k) {
      for (int32_t s = l.stages - 1; s >= 0; --s) {
        const int32_t m = l.micros - 1 - (k - (l.stages - 1 - s));
        if (m >= 0 && m < l.micros) {
          order.push_back({Kind::kBackward, s, m});
        }
      }
    }
  }
  return order;
}

std::vector<Action> one_f_one_b_order(const Layout& l) {
  std::vector<std::vector<Action>> lanes(l.stages);
  for (int32_t s = 0; s < l.stages; ++s) {
    const int32_t warmup = std::min(l.stages - s - 1, l.micros);
    int32_t f = 0;
    int32_t b = 0;
    for (; f < warmup; ++f) {
      lanes[s].push_back({Kind::kForward, s, f});
    }
    for (; f < l.micros; ++f, ++b) {
      lanes[s].push_back({Kind::kForward, s, f});
      lanes[s].push_back({Kind::kBackward, s, b});
    }
    for (; b < l.micros; ++b) {
      lanes[s].push_back({Kind::kBackward, s, b});
    }
  }
  return merge(l, lanes);
}

// Stage s keeps 1F1B's forwards and B passes, so at most min(stages - s,
// micros) micro-batches wait for their B there, and defers its W passes
// while at most s are pending. Stage s finishes its last B s steps before
// stage 0 does (that gradient still travels through stages s - 1 .. 0): the
// s deferred W passes fill that tail instead of idling. With unit forward,
// B and W costs every stage then idles stages - 1 units, against three
// times that for 1F1B.
std::vector<Action> zb_h1_order(const Layout& l) {
  std::vector<std::vector<Action>> lanes(l.stages);
  for (int32_t s = 0; s < l.stages; ++s) {
    const int32_t warmup = std::min(l.stages - s - 1, l.micros);
    std::deque<int32_t> pending;
    int32_t f = 0;
    for (; f < warmup; ++f) {
      lanes[s].push_back({Kind::kForward, s, f});
    }
    for (int32_t b = 0; b < l.micros; ++b) {
      if (f < l.micros) {
        lanes[s].push_back({Kind::kForward, s, f++});
      }
      lanes[s].push_back({Kind::kBackward, s, b});
      pending.push_back(b);
      while (static_cast<int32_t>(pending.size()) > s) {
        lanes[s].push_back({Kind::kWeight, s, pending.front()});
        pending.pop_front();
      }
    }
    for (int32_t m : pending) {
      lanes[s].push_back({Kind::kWeight, s, m});
    }
  }
  return merge(l, lanes);
}

// Rank r holds stages r, r + p, ..., r + (v - 1)p (its chunks 0 .. v - 1).
// Micro-batches go in groups of p: a rank forwards every micro-batch of a
// group through chunk 0, then chunk 1, and so on, and back-propagates them
// through its chunks in reverse. Rank r first runs Megatron-LM's
// 2(p - r - 1) + (v - 1)p warm-up forwards, then alternates, then drains.
// A micro-batch count that is not a multiple of p is padded up to one and
// the padding's actions dropped: dropping actions only drops dependencies,
// so the order still cannot deadlock, and it can only lower the number of
// micro-batches in flight.
std::vector<std::vector<Action>> interleaved_lanes(const Layout& l, const char* name) {
  const int32_t v = l.virtual_stages;
  if (v < 1 || l.stages % v != 0) {
    throw std::invalid_argument(
        std::string(name) + ": " + std::to_string(l.stages) + " stages do not form ranks of " +
        std::to_string(v) + " virtual stages each (stages must be a multiple of virtual_stages)");
  }
  const int32_t p = l.stages / v;
  const int32_t padded = (l.micros + p - 1) / p * p;
  std::vector<std::pair<int32_t, int32_t>> table;  // (chunk, micro-batch)
  for (int32_t group = 0; group < padded; group += p) {
    for (int32_t c = 0; c < v; ++c) {
      for (int32_t m = group; m < group + p; ++m) {
        table.emplace_back(c, m);
      }
    }
  }
  const auto total = static_cast<int32_t>(table.size());
  std::vector<std::vector<Action>> lanes(p);
  for (int32_t r = 0; r < p; ++r) {
    const auto forward = [&](int32_t k) {
      return Action{Kind::kForward, table[k].first * p + r, table[k].second};
    };
    const auto backward = [&](int32_t k) {
      return Action{Kind::kBackward, (v - 1 - table[k].first) * p + r, table[k].second};
    };
    const int32_t warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
    std::vector<Action> lane;
    for (int32_t k = 0; k < warmup; ++k) {
      lane.push_back(forward(k));
    }
    for (int32_t k = 0; k + warmup < total; ++k) {
      lane.push_back(forward(k + warmup));
      lane.push_back(backward(k));
    }
    for (int32_t k = total - warmup; k < total; ++k) {
      lane.push_back(backward(k));
    }
    for (const Action& a : lane) {
      if (a.micro < l.micros) {
        lanes[r].push_back(a);
      }
    }
  }
  return lanes;
}

std::vector<Action> interleaved_order(const Layout& l) {
  return merge(l, interleaved_lanes(l, "interleaved_1f1b"));
}

OrderProblem check_order(const Layout& l, const std::vector<Action>& actions) {
  check_layout(l);
  using Key = std::tuple<int, int32_t, int32_t>;
  const auto key = [](Kind k, int32_t s, int32_t m) { return Key{static_cast<int>(k), s, m}; };
  std::map<Key, int32_t> first;  // where each action is (first occurrence)
  const auto n = static_cast<int32_t>(actions.size());
  for (int32_t i = 0; i < n; ++i) {
    const Action& a = actions[i];
    const std::string what = action_name(a);
    if (a.kind != Kind::kForward && a.kind != Kind::kBackward && a.kind != Kind::kWeight) {
      return {i, "step " + std::to_string(i) + " is not a forward, backward or weight action"};
    }
    if (a.stage < 0 || a.stage >= l.stages) {
      return {i, what + ": the pipeline has no stage " + std::to_string(a.stage) + " (stages 0-" +
                     std::to_string(l.stages - 1) + ")"};
    }
    if (a.micro < 0 || a.micro >= l.micros) {
      return {i, what + ": the step has no micro-batch " + std::to_string(a.micro) +
                     " (micro-batches 0-" + std::to_string(l.micros - 1) + ")"};
    }
    auto [it, fresh] = first.emplace(key(a.kind, a.stage, a.micro), i);
    if (!fresh) {
      return {i, what + " appears twice (first at step " + std::to_string(it->second) + ")"};
    }
  }
  std::vector<std::vector<int32_t>> readers(l.stages);
  for (int32_t q = 0; q < l.stages; ++q) {
    for (int32_t p : l.reads[q]) {
      if (p >= 0) {
        readers[p].push_back(q);
      }
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    const Action& a = actions[i];
    const auto needs = [&](Kind k, int32_t s, const std::string& why) -> OrderProblem {
      const Action dep{k, s, a.micro};
      auto it = first.find(key(k, s, a.micro));
      if (it == first.end()) {
        return {i, action_name(a) + " needs " + action_name(dep) + why +
                       ", which the order does not contain"};
      }
      if (it->second > i) {
        return {i, action_name(a) + " needs " + action_name(dep) + why +
                       ", which comes later (step " + std::to_string(it->second) + ")"};
      }
      return {};
    };
    OrderProblem problem;
    const auto first_of = [&](const OrderProblem& p) {
      if (problem.message.empty() && !p.message.empty()) {
        problem = p;
      }
    };
    if (a.kind == Kind::kForward) {
      for (int32_t p : l.reads[a.stage]) {
        if (p >= 0) {
          first_of(needs(Kind::kForward, p,
                         " (stage " + std::to_string(a.stage) + " reads stage " +
                             std::to_string(p) + "'s output)"));
        }
      }
    } else if (a.kind == Kind::kBackward) {
      first_of(needs(Kind::kForward, a.stage, ""));
      for (int32_t q : readers[a.stage]) {
        first_of(needs(Kind::kBackward, q,
                       " (the gradient of stage " + std::to_string(a.stage) +
                           "'s output comes from stage " + std::to_string(q) + ")"));
      }
    } else {
      first_of(needs(Kind::kBackward, a.stage, " (W follows the B it splits from)"));
    }
    if (!problem.message.empty()) {
      return problem;
    }
  }
  for (int32_t s = 0; s < l.stages; ++s) {
    for (int32_t m = 0; m < l.micros; ++m) {
      for (Kind k : {Kind::kForward, Kind::kBackward}) {
        if (!first.count(key(k, s, m))) {
          return {-1, "the order has no " + action_name(Action{k, s, m}) +
                          ": every stage forwards and back-propagates every micro-batch once"};
        }
      }
    }
  }
  return {};
}

}  // namespace mpstream
