// Runs and tasks: construction, starting a run, opening tasks (waits,
// current streams), autograd's gradient copies. How a task ends (its
// completion event) and how a run ends (join, abort) are in finish.cpp. See scheduler.h for the
// model and events.cpp for ordering.
#include <algorithm>
#include <stdexcept>
#include <thread>

#include "scheduler_impl.h"

namespace mpstream {

using detail::exchange;
using detail::exchange_device;
using detail::make_stream;
using detail::restore;
using detail::restore_device;

Scheduler::Scheduler(std::vector<SlotSpec> stage_slots, std::vector<SlotSpec> caller_slots,
                     std::vector<int32_t> caller_of_stage, std::vector<SlotSpec> io_slots)
    : caller_of_stage_(std::move(caller_of_stage)) {
  if (stage_slots.empty() || stage_slots.size() % 2 != 0) {
    throw std::invalid_argument("stage_slots must hold two slots (compute, copy) per stage");
  }
  stages_ = static_cast<int32_t>(stage_slots.size() / 2);
  if (static_cast<int32_t>(caller_of_stage_.size()) != stages_) {
    throw std::invalid_argument("caller_of_stage must have one entry per stage");
  }
  for (int32_t c : caller_of_stage_) {
    if (c < 0 || c >= static_cast<int32_t>(caller_slots.size())) {
      throw std::invalid_argument("caller_of_stage refers to a missing caller slot");
    }
  }
  if (io_slots.size() != caller_slots.size()) {
    throw std::invalid_argument("io_slots must hold one slot per caller slot");
  }
  for (size_t c = 0; c < io_slots.size(); ++c) {
    if (io_slots[c].device_type != caller_slots[c].device_type ||
        io_slots[c].device_index != caller_slots[c].device_index) {
      throw std::invalid_argument("io slot " + std::to_string(c) +
                                  " is not on its caller slot's device");
    }
  }
  callers_ = static_cast<int32_t>(caller_slots.size());
  std::vector<SlotSpec> all = std::move(stage_slots);
  for (auto& spec : caller_slots) {
    all.push_back(std::move(spec));
  }
  for (auto& spec : io_slots) {
    all.push_back(std::move(spec));
  }
  std::vector<std::tuple<int8_t, int8_t, bool>> pools;
  const size_t n = all.size();
  for (size_t i = 0; i < n; ++i) {
    Slot slot;
    slot.spec = all[i];
    if (slot.spec.stream_id) {
      slot.stream = make_stream(slot.spec);
    }
    const auto key = std::make_tuple(slot.spec.device_type, slot.spec.device_index,
                                     slot.spec.stream_id.has_value());
    auto it = std::find(pools.begin(), pools.end(), key);
    slot.pool = static_cast<int32_t>(it - pools.begin());
    if (it == pools.end()) {
      pools.push_back(key);
    }
    slot.vc.assign(n, 0);
    slots_.push_back(std::move(slot));
  }
  const int32_t first_caller = 2 * stages_;
  for (int32_t s = 0; s < stages_; ++s) {
    const int32_t c = first_caller + caller_of_stage_[s];
    const auto& cs = slots_[c].spec;
    for (int32_t slot : {compute_slot(s), copy_slot(s)}) {
      const auto& spec = slots_[slot].spec;
      if (spec.device_type != cs.device_type || spec.device_index != cs.device_index) {
        throw std::invalid_argument("stage " + std::to_string(s) +
                                    ": slot device differs from its caller slot's device");
      }
      slots_[slot].ref = c;
    }
  }
  for (int32_t c = first_caller; c < first_caller + callers_; ++c) {
    slots_[c].ref = c;
    slots_[c + callers_].ref = c;  // its io slot
  }
  free_.resize(pools.size());
  timing_free_.resize(pools.size());
  reference_.resize(n);
}

Scheduler::~Scheduler() {
  // Streams a failed task made current must not outlive the scheduler; only
  // this thread's can be put back from here (current streams are per thread).
  for (auto& o : open_) {
    if (o && o->active && o->thread == std::this_thread::get_id()) {
      restore_streams(*o);
    }
  }
}

std::unique_lock<std::mutex> Scheduler::lock() const {
  std::unique_lock<std::mutex> held(mu_, std::try_to_lock);
  if (!held.owns_lock()) {
    if (contention_) {
      contention_(held);
    } else {
      held.lock();
    }
  }
  return held;
}

std::vector<SlotSpec> Scheduler::slots() const {
  std::vector<SlotSpec> out;
  for (const auto& s : slots_) {
    out.push_back(s.spec);
  }
  return out;
}

int32_t Scheduler::caller_slot(int32_t stage) const {
  return 2 * stages_ + caller_of_stage_[stage];
}

int32_t Scheduler::io_slot(int32_t stage) const {
  return caller_slot(stage) + callers_;
}

bool Scheduler::same_device(int32_t a, int32_t b) const {
  const auto& x = slots_[a].spec;
  const auto& y = slots_[b].spec;
  return x.device_type == y.device_type && x.device_index == y.device_index;
}

std::pair<int32_t, int32_t> Scheduler::task_slots(const Task& t) const {
  switch (t.kind) {
    case Kind::kForward:
    case Kind::kBackward:
    case Kind::kWeight:
      return {compute_slot(t.stage), compute_slot(t.stage)};
    case Kind::kCopy:
      // The input comes from the host (or the caller's device): it lands on
      // the io slot of the receiving stage's device.
      if (t.stage < 0) {
        return {-1, io_slot(t.peer)};
      }
      return {copy_slot(t.stage), copy_slot(t.peer)};
    case Kind::kCopyGrad:
      return {copy_slot(t.peer), copy_slot(t.stage)};
    case Kind::kTarget:
      return {-1, io_slot(t.stage)};
  }
  throw std::logic_error("unknown task kind");
}

int32_t Scheduler::wait_slot(const Task& t) const {
  const auto [issue, rec] = task_slots(t);
  return issue >= 0 ? issue : rec;
}

void Scheduler::begin_run(std::shared_ptr<const Schedule> schedule,
                          const std::vector<std::optional<int64_t>>& caller_streams) {
  const auto held = lock();
  if (running_) {
    throw std::runtime_error(
        "a pipeline run is already in progress on this scheduler: a Pipe runs "
        "one call at a time (a forward that re-entered the same Pipe, or a call "
        "from another thread while one runs?)");
  }
  if (!schedule) {
    throw std::invalid_argument("begin_run needs a schedule");
  }
  if (schedule->layout.stages != stages_) {
    throw std::invalid_argument("schedule has " + std::to_string(schedule->layout.stages) +
                                " stages, the scheduler " + std::to_string(stages_));
  }
  const int32_t first_caller = 2 * stages_;
  const auto callers = static_cast<size_t>(callers_);
  if (caller_streams.size() != callers) {
    throw std::invalid_argument("begin_run needs one caller stream per caller slot (" +
                                std::to_string(callers) + ")");
  }
  for (size_t c = 0; c < callers; ++c) {
    const int32_t slot = first_caller + static_cast<int32_t>(c);
    const Slot& s = slots_[slot];
    if (caller_streams[c].has_value() != s.spec.stream_id.has_value()) {
      throw std::invalid_argument("caller slot '" + s.spec.name +
                                  (caller_streams[c] ? "' is a placeholder but got a stream"
                                                     : "' needs a stream"));
    }
  }
  for (auto& s : slots_) {
    if (s.latest >= 0) {
      unref(s.latest);
      s.latest = -1;
    }
    std::fill(s.vc.begin(), s.vc.end(), 0);
  }
  for (size_t c = 0; c < callers; ++c) {
    Slot& s = slots_[first_caller + static_cast<int32_t>(c)];
    if (caller_streams[c]) {
      s.spec.stream_id = caller_streams[c];
      s.stream = make_stream(s.spec);
    }
  }
  schedule_ = std::move(schedule);
  const size_t n = schedule_->tasks.size();
  task_event_.assign(n, -1);
  pending_.assign(n, 0);
  begun_.assign(n, 0);
  // A dependency recorded on the slot that waits for it is ordered by the
  // stream itself; only cross-slot dependencies keep an event alive.
  for (const auto& t : schedule_->tasks) {
    const int32_t at = wait_slot(t);
    for (int32_t d : t.deps) {
      if (task_slots(schedule_->tasks[d]).second != at) {
        ++pending_[d];
      }
    }
  }
  if (timing_) {
    ensure_reference();
    harvest_timings();
  }
  ++runs_;
  for (size_t c = 0; c < callers; ++c) {
    record(first_caller + static_cast<int32_t>(c), Who{});
  }
  running_ = true;
}

int64_t Scheduler::open(const Who& who, int32_t issue, int32_t rec) {
  int64_t handle;
  if (!open_free_.empty()) {
    handle = open_free_.back();
    open_free_.pop_back();
  } else {
    open_.push_back(std::make_unique<Open>());
    handle = static_cast<int64_t>(open_.size() - 1);
  }
  Open& o = *open_[handle];
  o = Open{};
  o.task = who.task;
  o.kind = who.kind;
  o.stage = who.stage;
  o.peer = who.peer;
  o.micro = who.micro;
  o.issue = issue;
  o.rec = rec;
  o.active = true;
  o.thread = std::this_thread::get_id();
  const int32_t at = issue >= 0 ? issue : rec;
  log(OpCode::kRun, at, -1, who);
  // The task's device becomes current too: code in a stage that asks for
  // the current device (factory calls with device="cuda", current_stream(),
  // custom kernels) must land on the stage's device and stream.
  o.prev_device = exchange_device(slots_[at].stream);
  if (issue >= 0) {
    o.prev_issue = exchange(slots_[issue].stream);
  }
  // Across devices both ends are current (a copy runs on the source's
  // stream, the result is allocated on the destination's). On one device
  // only one stream can be current: the issuing one, which the task's waits
  // went to, so the copy runs after what it reads.
  if (rec != issue && (issue < 0 || !same_device(issue, rec))) {
    o.prev_rec = exchange(slots_[rec].stream);
  }
  if (timing_) {
    timing_mark(o, true);
  }
  return handle;
}

void Scheduler::restore_streams(Open& o) {
  restore(o.prev_rec);
  restore(o.prev_issue);
  restore_device(o.prev_device);
  o.prev_rec.reset();
  o.prev_issue.reset();
  o.prev_device.reset();
}

int64_t Scheduler::begin(int32_t task) {
  const auto held = lock();
  if (!running_) {
    throw std::runtime_error("begin() outside a run; call begin_run() first");
  }
  if (task < 0 || task >= static_cast<int32_t>(schedule_->tasks.size())) {
    throw std::out_of_range("task index " + std::to_string(task) + " out of range");
  }
  const Task& t = schedule_->tasks[task];
  if (begun_[task]) {
    // Its dependencies' events were released by the first begin(): a
    // second would release them again, while others still hold them.
    throw std::runtime_error("task " + std::to_string(task) + " (" + kind_name(t.kind) +
                             " of stage " + std::to_string(t.stage) + ", micro " +
                             std::to_string(t.micro) +
                             ") began twice in this run: each task begins once");
  }
  const Who who{task, t.kind, t.stage, t.peer, t.micro};
  const auto [issue, rec] = task_slots(t);
  const int32_t at = issue >= 0 ? issue : rec;
  for (int32_t d : t.deps) {
    if (task_event_[d] < 0) {
      throw std::runtime_error("task " + std::to_string(task) + " began before its dependency " +
                               std::to_string(d) + " ended");
    }
  }
  begun_[task] = 1;  // from here on its dependencies' events are released
  // A dependency recorded before another one it was ordered before (its
  // event is in the other's vector clock) needs no wait of its own: a
  // stage reading a skip connection and the stage after it waits only on
  // the latter.
  // Reads every dependency's event, so none may go back to the pool before
  // the loop below has asked about all of them (the unrefs come after it).
  const auto implied = [&](int32_t d) {
    const EventRec& rec = held_event(task_event_[d]);
    return std::any_of(t.deps.begin(), t.deps.end(), [&](int32_t other) {
      return other != d && task_slots(schedule_->tasks[other]).second != at &&
             held_event(task_event_[other]).vc[rec.slot] >= rec.seq;
    });
  };
  for (int32_t d : t.deps) {
    if (task_slots(schedule_->tasks[d]).second == at) {
      continue;  // same stream: program order
    }
    if (!implied(d)) {
      wait(at, task_event_[d], who);
    }
  }
  for (int32_t d : t.deps) {
    if (task_slots(schedule_->tasks[d]).second != at) {
      --pending_[d];
      unref(task_event_[d]);
    }
  }
  // After the data dependencies: a producer on the same device has usually
  // waited on the source already, which makes this wait implied. Input and
  // target transfers wait too: the caller may have filled a pinned buffer
  // with an asynchronous copy on its stream.
  const bool input_copy = t.kind == Kind::kCopy && t.stage < 0;
  if (t.kind == Kind::kForward || t.kind == Kind::kBackward || t.kind == Kind::kWeight ||
      input_copy || t.kind == Kind::kTarget) {
    const int32_t source = slots_[slots_[at].ref].latest;  // its device's caller slot's
    if (source >= 0) {
      wait(at, source, who);
    }
  }
  return open(who, issue, rec);
}

int64_t Scheduler::begin_grad_copy(int32_t stage, int32_t peer, int32_t micro) {
  const auto held = lock();
  if (stage < 0 || peer <= stage || peer >= stages_) {
    throw std::out_of_range("gradient copy from stage " + std::to_string(peer) + " to " +
                            std::to_string(stage) + " is outside the pipeline");
  }
  // Autograd runs the Copy node on the stream its forward made current for
  // its outputs, and has made that stream wait for the incoming gradient:
  // the copy must run there. Across devices that is the receiving side of
  // the forward copy (`peer`'s copy slot); on one device, where only the
  // forward copy's issuing slot was current, it is stage `stage`'s.
  const int32_t node = same_device(copy_slot(stage), copy_slot(peer)) ? copy_slot(stage)
                                                                      : copy_slot(peer);
  return open(Who{-1, Kind::kCopyGrad, stage, peer, micro}, node, copy_slot(stage));
}

void Scheduler::set_autograd_orders_grad_copies(bool on) {
  const auto held = lock();
  autograd_orders_ = on;
}

bool Scheduler::autograd_orders_grad_copies() const {
  const auto held = lock();
  return autograd_orders_;
}

bool Scheduler::running() const {
  const auto held = lock();
  return running_;
}

}  // namespace mpstream
