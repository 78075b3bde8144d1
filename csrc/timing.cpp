// Observation of a scheduler: the recorded plan, per-task timing (device
// events on streams, the host clock on placeholders) and pool statistics.
#include <stdexcept>

#include "scheduler_impl.h"

namespace mpstream {

using detail::now_ns;

void Scheduler::set_recording(bool on) {
  const auto held = lock();
  recording_ = on;
}

bool Scheduler::recording() const {
  const auto held = lock();
  return recording_;
}

std::vector<PlanOp> Scheduler::plan() const {
  const auto held = lock();
  return plan_;
}

void Scheduler::clear_plan() {
  const auto held = lock();
  plan_.clear();
}

void Scheduler::set_timing(bool on) {
  const auto held = lock();
  if (on && capturing_) {
    throw std::runtime_error(
        "timing cannot start while a CUDA graph captures this scheduler's streams: its "
        "events would be recorded into the graph, and a replay times nothing");
  }
  timing_ = on;
  if (on) {
    // Now rather than at the next run: a caller that synchronized its
    // devices first gets references recorded on idle streams, which align
    // the devices' clocks to within the launch skew of these records.
    ensure_reference();
  }
}

void Scheduler::set_capturing(bool on) {
  const auto held = lock();
  if (on && timing_) {
    throw std::runtime_error(
        "a CUDA graph cannot capture this scheduler's streams while timing is on: its "
        "events would be recorded into the graph, and a replay times nothing; switch "
        "timing off first");
  }
  capturing_ = on;
}

bool Scheduler::capturing() const {
  const auto held = lock();
  return capturing_;
}

bool Scheduler::timing() const {
  const auto held = lock();
  return timing_;
}

void Scheduler::ensure_reference() {
  if (have_reference_) {
    return;
  }
  host_t0_ = std::chrono::steady_clock::now();
  const int32_t first_caller = 2 * stages_;
  for (int32_t c = first_caller; c < first_caller + callers_; ++c) {
    const Slot& s = slots_[c];
    if (!s.stream) {
      continue;
    }
    reference_[c].emplace(s.stream->device_type(), c10::EventFlag::BACKEND_DEFAULT);
    reference_[c]->record(*s.stream);
  }
  have_reference_ = true;
}

int32_t Scheduler::take_timing_event(int32_t slot) {
  const Slot& s = slots_[slot];
  auto& free = timing_free_[s.pool];
  if (!free.empty()) {
    const int32_t id = free.back();
    free.pop_back();
    return id;
  }
  timing_events_.emplace_back();
  timing_events_.back().emplace(s.stream->device_type(), c10::EventFlag::BACKEND_DEFAULT);
  timing_event_pool_.push_back(s.pool);
  return static_cast<int32_t>(timing_events_.size() - 1);
}

void Scheduler::timing_mark(Open& o, bool start) {
  const int64_t host_now = now_ns();
  ensure_reference();
  if (start) {
    TimedTask t{o.kind, o.stage, o.peer, o.micro, o.rec, o.issue >= 0 ? o.issue : o.rec};
    t.run = runs_;
    o.timed = static_cast<int32_t>(timed_.size());
    o.timed_generation = timing_generation_;
    timed_.push_back(std::move(t));
  } else if (o.timed < 0 || o.timed_generation != timing_generation_ ||
             timed_[o.timed].dropped) {
    return;  // started before the timings were cleared, or in a failed run
  }
  TimedTask& t = timed_[o.timed];
  const int32_t slot = start ? t.start_slot : t.slot;
  const Slot& s = slots_[slot];
  if (s.stream) {
    const int32_t ev = take_timing_event(slot);
    timing_events_[ev]->record(*s.stream);
    (start ? t.start : t.end) = ev;
  } else {
    (start ? t.host_start_ns : t.host_end_ns) = host_now;
  }
  // On a GPU the device times say when the work ran; the host clock says
  // what issuing it cost the one thread that issues every task.
  (start ? t.issue_start_ns : t.issue_end_ns) = start ? host_now : now_ns();
  t.done = !start;
}

bool Scheduler::resolve(TimedTask& t, bool wait) {
  if (t.resolved || !t.done) {
    return t.resolved;
  }
  const int64_t t0 = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         host_t0_.time_since_epoch())
                         .count();
  auto ready = [&](int32_t slot, int32_t ev) {
    if (ev < 0) {
      return true;
    }
    const auto& ref = reference_[slots_[slot].ref];
    if (wait) {
      host_wait(*ref);
      host_wait(*timing_events_[ev]);
      return true;
    }
    return ref->query() && timing_events_[ev]->query();
  };
  if (!ready(t.start_slot, t.start) || !ready(t.slot, t.end)) {
    return false;
  }
  auto ms = [&](int32_t slot, int32_t& ev, int64_t host_ns) {
    if (ev < 0) {
      return static_cast<double>(host_ns - t0) / 1e6;
    }
    const double out = reference_[slots_[slot].ref]->elapsedTime(*timing_events_[ev]);
    timing_free_[timing_event_pool_[ev]].push_back(ev);
    ev = -1;
    return out;
  };
  t.start_ms = ms(t.start_slot, t.start, t.host_start_ns);
  t.end_ms = ms(t.slot, t.end, t.host_end_ns);
  t.resolved = true;
  return true;
}

void Scheduler::harvest_timings() {
  for (size_t i = unresolved_from_; i < timed_.size(); ++i) {
    resolve(timed_[i], false);
  }
  while (unresolved_from_ < timed_.size() && timed_[unresolved_from_].resolved) {
    ++unresolved_from_;
  }
}

int64_t Scheduler::run_tag() const {
  const auto held = lock();
  return (timing_generation_ << 32) | runs_;
}

int64_t Scheduler::begin_mark(Kind kind, int32_t stage, int32_t micro, int64_t run_tag) {
  const auto held = lock();
  if (!timing_) {
    return -1;
  }
  if (stage < 0 || stage >= stages_) {
    throw std::out_of_range("mark for stage " + std::to_string(stage) + " outside the pipeline");
  }
  Open o;
  o.kind = kind;
  o.stage = o.peer = stage;
  o.micro = micro;
  o.issue = o.rec = compute_slot(stage);
  timing_mark(o, true);
  if (run_tag >= 0) {
    // The run whose forward built the graph; 0 for one before the timings
    // were cleared (runs count from 1 since then).
    timed_[o.timed].run = (run_tag >> 32) == timing_generation_ ? (run_tag & 0xffffffff) : 0;
  }
  // The generation rides along so a mark from before clear_timings is void.
  return (timing_generation_ << 32) | o.timed;
}

void Scheduler::end_mark(int64_t mark) {
  const auto held = lock();
  if (mark < 0) {
    return;  // timing was off when the mark began
  }
  const int64_t index = mark & 0xffffffff;
  const int64_t generation = mark >> 32;
  if (generation > timing_generation_ ||
      (generation == timing_generation_ && index >= static_cast<int64_t>(timed_.size()))) {
    throw std::invalid_argument("end_mark() got " + std::to_string(mark) +
                                ", which no begin_mark() returned");
  }
  if (generation == timing_generation_ && timed_[index].done) {
    return;  // ended already: the first end stands, and its event stays counted
  }
  Open o;
  o.timed = static_cast<int32_t>(index);
  o.timed_generation = generation;
  timing_mark(o, false);
}

void Scheduler::drop_run_timings() {
  // A failed run's spans (a few tasks, some never ended) would be averaged
  // with whole runs, and one never ended would keep harvest_timings() from
  // moving past it. Their events go back to the pool: a later record on
  // one simply replaces this one.
  for (auto& t : timed_) {
    if (t.run != runs_) {
      continue;
    }
    for (int32_t* ev : {&t.start, &t.end}) {
      if (*ev >= 0) {
        timing_free_[timing_event_pool_[*ev]].push_back(*ev);
        *ev = -1;
      }
    }
    t.resolved = t.dropped = true;
  }
  harvest_timings();
}

std::vector<Timing> Scheduler::timings() {
  const auto held = lock();
  std::vector<Timing> out;
  for (auto& t : timed_) {
    if (t.dropped || !resolve(t, true)) {
      continue;  // its run failed, or still open
    }
    const double issue_ms = static_cast<double>(t.issue_end_ns - t.issue_start_ns) / 1e6;
    out.push_back(Timing{t.kind, t.stage, t.peer, t.micro, t.slot, t.start_ms, t.end_ms, t.run,
                         issue_ms});
  }
  return out;
}

void Scheduler::clear_timings() {
  const auto held = lock();
  for (auto& t : timed_) {
    for (int32_t ev : {t.start, t.end}) {
      if (ev >= 0) {
        // Recorded work may still be running: a later record on a pooled
        // event simply replaces this one.
        timing_free_[timing_event_pool_[ev]].push_back(ev);
      }
    }
  }
  timed_.clear();
  unresolved_from_ = 0;
  runs_ = 0;
  ++timing_generation_;
  for (auto& r : reference_) {
    r.reset();
  }
  have_reference_ = false;
  if (timing_) {
    ensure_reference();
  }
}

int64_t Scheduler::events_created() const {
  const auto held = lock();
  return static_cast<int64_t>(events_.size());
}

int64_t Scheduler::events_free() const {
  const auto held = lock();
  int64_t n = 0;
  for (const auto& f : free_) {
    n += static_cast<int64_t>(f.size());
  }
  return n;
}

int64_t Scheduler::timing_events_created() const {
  const auto held = lock();
  return static_cast<int64_t>(timing_events_.size());
}

}  // namespace mpstream
