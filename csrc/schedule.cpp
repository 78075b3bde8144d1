// Schedules over a stage graph: the builder that turns an issue order of
// compute actions into tasks with dependencies (copies included), and the
// checks of explicit orders. The built-in orders come from orders.cpp.
#include "schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

#include "orders.h"

namespace mpstream {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kForward:
      return "forward";
    case Kind::kBackward:
      return "backward";
    case Kind::kCopy:
      return "copy";
    case Kind::kCopyGrad:
      return "copy_grad";
    case Kind::kTarget:
      return "target";
    case Kind::kWeight:
      return "weight";
  }
  return "unknown";
}

namespace {

// A built-in schedule: its name, the placement it needs and its order.
struct BuiltIn {
  const char* name;
  const char* placement;
  std::vector<Action> (*order)(const Layout&);
};

std::vector<Action> gpipe_training(const Layout& l) {
  return gpipe_order(l, true);
}

const std::vector<BuiltIn>& built_ins() {
  static const std::vector<BuiltIn> all = {
      {"gpipe", "stage", gpipe_training},
      {"1f1b", "stage", one_f_one_b_order},
      {"interleaved_1f1b", "round_robin", interleaved_order},
      {"zb_h1", "stage", zb_h1_order},
      {"looped_bfs", "round_robin", looped_bfs_order},
      {"interleaved_zb", "round_robin", interleaved_zb_order},
      {"zbv", "v", zbv_order},
      {"dualpipev", "v", dualpipev_order},
  };
  return all;
}

}  // namespace

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const BuiltIn& b : built_ins()) {
    names.emplace_back(b.name);
  }
  return names;
}

std::vector<std::pair<std::string, std::string>> schedule_placements() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const BuiltIn& b : built_ins()) {
    out.emplace_back(b.name, b.placement);
  }
  return out;
}

std::string action_name(const Action& a) {
  const char* letter = a.kind == Kind::kForward ? "F" : a.kind == Kind::kBackward ? "B" : "W";
  return letter + std::to_string(a.stage) + "m" + std::to_string(a.micro);
}

Layout chain_layout(int32_t micros, const std::vector<bool>& copy_in) {
  Layout l;
  l.stages = static_cast<int32_t>(copy_in.size());
  l.micros = micros;
  int32_t device = 0;
  l.input_device = copy_in.empty() || !copy_in[0] ? 0 : -1;
  for (int32_t s = 0; s < l.stages; ++s) {
    if (s > 0 && copy_in[s]) {
      ++device;
    }
    l.device.push_back(device);
    l.reads.push_back({s - 1});
  }
  return l;
}

void check_layout(const Layout& l) {
  if (l.stages < 1) {
    throw std::invalid_argument("a schedule needs at least one stage, got " +
                                std::to_string(l.stages));
  }
  if (l.micros < 1) {
    throw std::invalid_argument("a schedule needs at least one micro-batch, got " +
                                std::to_string(l.micros));
  }
  // Far above any pipeline, and low enough that task indices (int32) and
  // the orders' per (stage, micro-batch) tables stay in range.
  constexpr int64_t kMaxPairs = int64_t{1} << 24;
  if (static_cast<int64_t>(l.stages) * l.micros > kMaxPairs) {
    throw std::invalid_argument(
        "a schedule of " + std::to_string(l.stages) + " stages and " + std::to_string(l.micros) +
        " micro-batches has more than 2^24 (stage, micro-batch) pairs; use fewer micro-batches");
  }
  if (static_cast<int32_t>(l.reads.size()) != l.stages ||
      static_cast<int32_t>(l.device.size()) != l.stages) {
    throw std::invalid_argument("reads and device must have one entry per stage (" +
                                std::to_string(l.stages) + ")");
  }
  for (int32_t s = 0; s < l.stages; ++s) {
    int32_t previous = -2;
    for (int32_t p : l.reads[s]) {
      if (p < -1 || p >= s || p <= previous) {
        throw std::invalid_argument(
            "stage " + std::to_string(s) + " reads stage " + std::to_string(p) +
            ": a stage reads earlier stages (or -1, the input), each once, in order");
      }
      previous = p;
    }
  }
}

namespace {

// The stages on one device that read one producer's outputs: one copy task
// brings the value there (when it crosses devices), received by `peer`.
struct Group {
  int32_t producer;
  int32_t peer;
  std::vector<int32_t> readers;
  bool copy;
};

// Appends tasks in issue order and resolves their dependencies by
// (kind, stage, peer, micro), so generators only decide the order.
class Builder {
 public:
  explicit Builder(const Layout& layout)
      : layout_(layout), groups_(static_cast<size_t>(layout.stages) + 1) {
    // With force_copies every stage counts as a device of its own (the data
    // flow of one device per stage), except for reads of the input, which
    // move only when it sits elsewhere.
    for (int32_t q = 0; q < layout.stages; ++q) {
      for (int32_t p : layout.reads[q]) {
        auto& groups = groups_[p + 1];
        const bool own = layout.force_copies && p >= 0;
        auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
          return own ? g.peer == q : layout.device[g.peer] == layout.device[q];
        });
        if (it != groups.end()) {
          it->readers.push_back(q);
          continue;
        }
        const bool copy = p < 0 ? layout.input_device != layout.device[q]
                                : layout.force_copies || layout.device[p] != layout.device[q];
        groups.push_back(Group{p, q, {q}, copy});
      }
    }
  }

  void forward(int32_t s, int32_t m) {
    std::vector<int32_t> deps;
    for (int32_t p : layout_.reads[s]) {
      const Group& g = group_of(p, s);
      if (g.copy) {
        deps.push_back(find(Kind::kCopy, p, g.peer, m));
      } else if (p >= 0) {
        deps.push_back(find(Kind::kForward, p, p, m));
      }
    }
    if (layout_.copy_target && s == layout_.stages - 1) {
      deps.push_back(find(Kind::kTarget, s, s, m));  // the loss reads it
    }
    add(Kind::kForward, s, s, m, std::move(deps));
    for (const Group& g : groups_[s + 1]) {
      if (g.copy) {
        add(Kind::kCopy, s, g.peer, m, {find(Kind::kForward, s, s, m)});
      }
    }
  }

  // The host-side transfers of micro-batch m: its input and, in a training
  // step, its target. Issued ahead of the compute that reads them.
  void input_copy(int32_t m) {
    for (const Group& g : groups_[0]) {
      if (g.copy && !has(Kind::kCopy, -1, g.peer, m)) {
        add(Kind::kCopy, -1, g.peer, m, {});
      }
    }
    const int32_t last = layout_.stages - 1;
    if (layout_.copy_target && !has(Kind::kTarget, last, last, m)) {
      add(Kind::kTarget, last, last, m, {});
    }
  }

  void backward(int32_t s, int32_t m) {
    std::vector<int32_t> deps{find(Kind::kForward, s, s, m)};
    for (const Group& g : groups_[s + 1]) {
      if (g.copy) {
        deps.push_back(find(Kind::kCopyGrad, s, g.peer, m));
      } else {
        for (int32_t q : g.readers) {
          deps.push_back(find(Kind::kBackward, q, q, m));
        }
      }
    }
    add(Kind::kBackward, s, s, m, std::move(deps));
    // The gradient of a value copied to this device goes back once every
    // stage here that read it has back-propagated.
    for (int32_t p : layout_.reads[s]) {
      const Group& g = group_of(p, s);
      if (p < 0 || !g.copy) {
        continue;
      }
      std::vector<int32_t> readers;
      for (int32_t q : g.readers) {
        if (!has(Kind::kBackward, q, q, m)) {
          readers.clear();
          break;
        }
        readers.push_back(find(Kind::kBackward, q, q, m));
      }
      if (!readers.empty()) {
        add(Kind::kCopyGrad, p, g.peer, m, std::move(readers));
      }
    }
  }

  // The parameter gradients of a backward split in two: after its B task,
  // on the same stream.
  void weight(int32_t s, int32_t m) {
    add(Kind::kWeight, s, s, m, {find(Kind::kBackward, s, s, m)});
  }

  Schedule finish(const std::string& name) {
    Schedule out;
    out.name = name;
    out.layout = layout_;
    for (int32_t m = 0; m < layout_.micros; ++m) {
      const int32_t last = layout_.stages - 1;
      out.outputs.push_back(find(Kind::kForward, last, last, m));
    }
    out.tasks = std::move(tasks_);
    return out;
  }

 private:
  using Key = std::tuple<int8_t, int32_t, int32_t, int32_t>;

  static Key key(Kind k, int32_t s, int32_t peer, int32_t m) {
    return Key{static_cast<int8_t>(k), s, peer, m};
  }

  const Group& group_of(int32_t producer, int32_t reader) const {
    for (const Group& g : groups_[producer + 1]) {
      if (std::find(g.readers.begin(), g.readers.end(), reader) != g.readers.end()) {
        return g;
      }
    }
    throw std::logic_error("stage " + std::to_string(reader) + " does not read " +
                           std::to_string(producer));
  }

  bool has(Kind k, int32_t s, int32_t peer, int32_t m) const {
    return index_.count(key(k, s, peer, m)) != 0;
  }

  int32_t find(Kind k, int32_t s, int32_t peer, int32_t m) const {
    auto it = index_.find(key(k, s, peer, m));
    if (it == index_.end()) {
      throw std::logic_error(std::string("schedule issues a task before its dependency ") +
                             kind_name(k) + "(stage " + std::to_string(s) + ", micro-batch " +
                             std::to_string(m) + ")");
    }
    return it->second;
  }

  void add(Kind k, int32_t s, int32_t peer, int32_t m, std::vector<int32_t> deps) {
    Task t;
    t.index = static_cast<int32_t>(tasks_.size());
    t.kind = k;
    t.stage = s;
    t.peer = peer;
    t.micro = m;
    t.deps = std::move(deps);
    index_[key(k, s, peer, m)] = t.index;
    tasks_.push_back(std::move(t));
  }

  Layout layout_;
  std::vector<std::vector<Group>> groups_;  // per producer + 1
  std::vector<Task> tasks_;
  std::map<Key, int32_t> index_;
};

// Issues the actions in order, with the copies they need: a micro-batch's
// input (and target) transfers go out before its first forward, and the
// next micro-batch's with the first stage's forward, one ahead, so they
// overlap compute.
void issue(Builder& b, const Layout& l, const std::vector<Action>& actions) {
  b.input_copy(0);
  for (const Action& a : actions) {
    switch (a.kind) {
      case Kind::kForward:
        if (a.stage == 0 && a.micro + 1 < l.micros) {
          b.input_copy(a.micro + 1);
        }
        b.input_copy(a.micro);
        b.forward(a.stage, a.micro);
        break;
      case Kind::kBackward:
        b.backward(a.stage, a.micro);
        break;
      case Kind::kWeight:
        b.weight(a.stage, a.micro);
        break;
      default:
        throw std::invalid_argument("an issue order holds forward, backward and weight actions");
    }
  }
}

}  // namespace

Schedule make_schedule(const std::string& name, const Layout& layout, bool backward) {
  check_layout(layout);
  if (layout.copy_target && !backward && name == "gpipe") {
    throw std::invalid_argument("target copies belong to training steps (backward=true)");
  }
  const auto& all = built_ins();
  const auto it =
      std::find_if(all.begin(), all.end(), [&](const BuiltIn& b) { return name == b.name; });
  if (it == all.end()) {
    std::string valid;
    for (const auto& n : schedule_names()) {
      valid += (valid.empty() ? "'" : ", '") + n + "'";
    }
    throw std::invalid_argument("unknown schedule '" + name + "'; valid schedules: " + valid);
  }
  // Fill-drain alone also serves forward-only runs.
  const std::vector<Action> order =
      name == "gpipe" ? gpipe_order(layout, backward) : it->order(layout);
  Builder b(layout);
  issue(b, layout, order);
  return b.finish(name);
}

Schedule make_ordered_schedule(const Layout& layout, const std::vector<Action>& actions) {
  const OrderProblem problem = check_order(layout, actions);
  if (!problem.message.empty()) {
    throw std::invalid_argument(problem.message);
  }
  Builder b(layout);
  issue(b, layout, actions);
  return b.finish("custom");
}

}  // namespace mpstream
