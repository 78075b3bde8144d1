// Schedule generation: fill-drain (GPipe clock cycles) and 1F1B.
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

namespace {

// Appends tasks in issue order and resolves their dependencies by
// (kind, stage, micro), so generators only decide the order.
class Builder {
 public:
  explicit Builder(const Layout& layout) : layout_(layout) {}

  void forward(int32_t s, int32_t m) {
    std::vector<int32_t> deps;
    if (layout_.copy_in[s]) {
      deps.push_back(find(Kind::kCopy, s - 1, m));
    } else if (s > 0) {
      deps.push_back(find(Kind::kForward, s - 1, m));
    }
    if (layout_.copy_target && s == layout_.stages - 1) {
      deps.push_back(find(Kind::kTarget, s, m));  // the loss reads it
    }
    add(Kind::kForward, s, m, std::move(deps));
    if (s + 1 < layout_.stages && layout_.copy_in[s + 1]) {
      add(Kind::kCopy, s, m, {find(Kind::kForward, s, m)});
    }
  }

  // The host-side transfers of micro-batch m: its input and, in a training
  // step, its target. Issued ahead of the compute that reads them.
  void input_copy(int32_t m) {
    if (layout_.copy_in[0] && !has(Kind::kCopy, -1, m)) {
      add(Kind::kCopy, -1, m, {});
    }
    if (layout_.copy_target && !has(Kind::kTarget, layout_.stages - 1, m)) {
      add(Kind::kTarget, layout_.stages - 1, m, {});
    }
  }

  void backward(int32_t s, int32_t m) {
    std::vector<int32_t> deps{find(Kind::kForward, s, m)};
    if (s + 1 < layout_.stages) {
      deps.push_back(
          layout_.copy_in[s + 1] ? find(Kind::kCopyGrad, s, m)
                                 : find(Kind::kBackward, s + 1, m));
    }
    add(Kind::kBackward, s, m, std::move(deps));
    if (s > 0 && layout_.copy_in[s]) {
      add(Kind::kCopyGrad, s - 1, m, {find(Kind::kBackward, s, m)});
    }
  }

  Schedule finish(const std::string& name) {
    Schedule out;
    out.name = name;
    out.layout = layout_;
    for (int32_t m = 0; m < layout_.micros; ++m) {
      out.outputs.push_back(find(Kind::kForward, layout_.stages - 1, m));
    }
    out.tasks = std::move(tasks_);
    return out;
  }

 private:
  using Key = std::tuple<int8_t, int32_t, int32_t>;

  static Key key(Kind k, int32_t s, int32_t m) {
    return Key{static_cast<int8_t>(k), s, m};
  }

  bool has(Kind k, int32_t s, int32_t m) const {
    return index_.count(key(k, s, m)) != 0;
  }

  int32_t find(Kind k, int32_t s, int32_t m) const {
    auto it = index_.find(key(k, s, m));
    if (it == index_.end()) {
      throw std::logic_error(
          std::string("schedule issues a task before its dependency ") +
          kind_name(k) + "(stage " + std::to_string(s) + ", micro-batch " +
          std::to_string(m) + ")");
    }
    return it->second;
  }

  void add(Kind k, int32_t s, int32_t m, std::vector<int32_t> deps) {
    Task t;
    t.index = static_cast<int32_t>(tasks_.size());
    t.kind = k;
    t.stage = s;
    t.micro = m;
    t.deps = std::move(deps);
    index_[key(k, s, m)] = t.index;
    tasks_.push_back(std::move(t));
  }

  Layout layout_;
  std::vector<Task> tasks_;
  std::map<Key, int32_t> index_;
};

// Forwards in clock cycles: at cycle k stage s runs micro-batch k - s. Each
// input copy is issued one cycle ahead so it overlaps the previous compute.
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
// and double-cost backwards and sorting by start time, which is a
// topological order because every consumer starts after its producer ends.
void one_f_one_b(Builder& b, const Layout& l) {
  struct Op {
    bool backward;
    int32_t stage;
    int32_t micro;
    int64_t start = 0;
  };
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
  // finish[s][m] for forwards and backwards; -1 while not simulated.
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
      if (!op.backward && s > 0) {
        if (f_end[s - 1][op.micro] < 0) continue;
        ready = std::max(ready, f_end[s - 1][op.micro]);
      }
      if (op.backward && s + 1 < l.stages) {
        if (b_end[s + 1][op.micro] < 0) continue;
        ready = std::max(ready, b_end[s + 1][op.micro]);
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
  if (layout.stages < 1) {
    throw std::invalid_argument("a schedule needs at least one stage, got " +
                                std::to_string(layout.stages));
  }
  if (layout.micros < 1) {
    throw std::invalid_argument("a schedule needs at least one micro-batch, got " +
                                std::to_string(layout.micros));
  }
  if (static_cast<int32_t>(layout.copy_in.size()) != layout.stages) {
    throw std::invalid_argument("copy_in must have one entry per stage (" +
                                std::to_string(layout.stages) + "), got " +
                                std::to_string(layout.copy_in.size()));
  }
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
