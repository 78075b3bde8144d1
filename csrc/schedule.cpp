// Schedule generation over a stage graph: fill-drain (GPipe clock cycles)
// and 1F1B.
#include "schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

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
  }
  return "unknown";
}

std::vector<std::string> schedule_names() {
  return {"gpipe", "1f1b"};
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

namespace {

// The stages on one device that read one producer's outputs: one copy task
// brings the value there (when it crosses devices), received by `peer`.
struct Group {
  int32_t producer;
  int32_t peer;
  std::vector<int32_t> readers;
  bool copy;
};

void check(const Layout& l) {
  if (l.stages < 1) {
    throw std::invalid_argument("a schedule needs at least one stage, got " +
                                std::to_string(l.stages));
  }
  if (l.micros < 1) {
    throw std::invalid_argument("a schedule needs at least one micro-batch, got " +
                                std::to_string(l.micros));
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

// Forwards in clock cycles: at cycle k stage s runs micro-batch k - s. Each
// input copy is issued one cycle ahead so it overlaps the previous compute.
// Every read goes to an earlier stage, so the cycles are a topological order.
void gpipe_forward(Builder& b, const Layout& l) {
  b.input_copy(0);
  for (int32_t k = 0; k < l.micros + l.stages - 1; ++k) {
    if (k + 1 < l.micros) {
      b.input_copy(k + 1);
    }
    for (int32_t s = 0; s < l.stages; ++s) {
      const int32_t m = k - s;
      if (m >= 0 && m < l.micros) {
        b.input_copy(m);
        b.forward(s, m);
      }
    }
  }
}

// Backwards mirror the forward clock: the last stage starts with the last
// micro-batch, whose activations are the freshest.
void gpipe_backward(Builder& b, const Layout& l) {
  for (int32_t k = 0; k < l.micros + l.stages - 1; ++k) {
    for (int32_t s = l.stages - 1; s >= 0; --s) {
      const int32_t m = l.micros - 1 - (k - (l.stages - 1 - s));
      if (m >= 0 && m < l.micros) {
        b.backward(s, m);
      }
    }
  }
}

// 1F1B: stage s runs min(stages - s - 1, micros) warm-up forwards, then
// alternates one forward and one backward, then drains. The per-stage
// sequences are merged into one issue order by simulating unit-cost forwards
// and double-cost backwards over the stage graph and sorting by start time,
// which is a topological order because every consumer starts after its
// producers end.
void one_f_one_b(Builder& b, const Layout& l) {
  struct Op {
    bool backward;
    int32_t stage;
    int32_t micro;
    int64_t start = 0;
  };
  std::vector<std::vector<int32_t>> readers(l.stages);
  for (int32_t q = 0; q < l.stages; ++q) {
    for (int32_t p : l.reads[q]) {
      if (p >= 0) {
        readers[p].push_back(q);
      }
    }
  }
  std::vector<std::vector<Op>> per_stage(l.stages);
  for (int32_t s = 0; s < l.stages; ++s) {
    const int32_t warmup = std::min(l.stages - s - 1, l.micros);
    int32_t f = 0;
    int32_t bw = 0;
    for (; f < warmup; ++f) {
      per_stage[s].push_back({false, s, f});
    }
    while (f < l.micros) {
      per_stage[s].push_back({false, s, f++});
      per_stage[s].push_back({true, s, bw++});
    }
    while (bw < l.micros) {
      per_stage[s].push_back({true, s, bw++});
    }
  }
  // End times of forwards and backwards; -1 while not simulated.
  std::vector<std::vector<int64_t>> f_end(l.stages, std::vector<int64_t>(l.micros, -1));
  std::vector<std::vector<int64_t>> b_end(l.stages, std::vector<int64_t>(l.micros, -1));
  std::vector<size_t> next(l.stages, 0);
  std::vector<int64_t> free_at(l.stages, 0);
  std::vector<Op> order;
  size_t remaining = 0;
  for (const auto& ops : per_stage) {
    remaining += ops.size();
  }
  while (remaining > 0) {
    bool progressed = false;
    for (int32_t s = 0; s < l.stages; ++s) {
      if (next[s] >= per_stage[s].size()) {
        continue;
      }
      Op op = per_stage[s][next[s]];
      int64_t ready = free_at[s];
      bool blocked = false;
      for (int32_t q : op.backward ? readers[s] : l.reads[s]) {
        if (q < 0) {
          continue;
        }
        const int64_t end = (op.backward ? b_end : f_end)[q][op.micro];
        blocked = blocked || end < 0;
        ready = std::max(ready, end);
      }
      if (blocked) {
        continue;
      }
      op.start = ready;
      const int64_t end = ready + (op.backward ? 2 : 1);
      (op.backward ? b_end : f_end)[s][op.micro] = end;
      free_at[s] = end;
      order.push_back(op);
      ++next[s];
      --remaining;
      progressed = true;
    }
    if (!progressed) {
      throw std::logic_error("1f1b simulation deadlocked");
    }
  }
  std::stable_sort(order.begin(), order.end(), [](const Op& a, const Op& c) {
    return a.start < c.start;
  });
  b.input_copy(0);
  for (const Op& op : order) {
    if (op.backward) {
      b.backward(op.stage, op.micro);
    } else {
      if (op.stage == 0 && op.micro + 1 < l.micros) {
        b.input_copy(op.micro + 1);
      }
      b.input_copy(op.micro);
      b.forward(op.stage, op.micro);
    }
  }
}

}  // namespace

Schedule make_schedule(const std::string& name, const Layout& layout, bool backward) {
  check(layout);
  if (layout.copy_target && !backward && name == "gpipe") {
    throw std::invalid_argument("target copies belong to training steps (backward=true)");
  }
  Builder b(layout);
  if (name == "gpipe") {
    gpipe_forward(b, layout);
    if (backward) {
      gpipe_backward(b, layout);
    }
  } else if (name == "1f1b") {
    one_f_one_b(b, layout);
  } else {
    throw std::invalid_argument("unknown schedule '" + name +
                                "'; valid schedules: 'gpipe', '1f1b'");
  }
  return b.finish(name);
}

}  // namespace mpstream
