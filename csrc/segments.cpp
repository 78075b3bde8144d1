// Segmented runs: one run issued as consecutive segments, each of which the
// caller captures as a CUDA graph of its own.
//
// Inside a capture a stream may only wait on events recorded in the same
// capture, and every stream that joined it must rejoin the capturing
// stream before it ends. So a segment starts from a source of its own on
// the caller slot that captures it, waits only on events recorded inside
// it, and ends with that slot waiting on the last work of every slot the
// segment used. What a task reads from an earlier segment is ordered by an
// external event instead (recorded and waited on by the caller, which owns
// the CUDA events that a graph turns into record and wait nodes); the
// scheduler lists those waits and logs both ends, so the plan shows them.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "scheduler_impl.h"

namespace mpstream {

void Scheduler::set_caller(int32_t slot, std::optional<int64_t> stream) {
  Slot& s = slots_[slot];
  if (stream) {
    s.spec.stream_id = stream;
    s.stream = detail::make_stream(s.spec);
  }
}

void Scheduler::forget_latest() {
  for (auto& s : slots_) {
    if (s.latest >= 0) {
      unref(s.latest);
      s.latest = -1;
    }
    std::fill(s.vc.begin(), s.vc.end(), 0);
  }
  external_after_.assign(slots_.size(), false);
}

bool Scheduler::crossing(int32_t task) const {
  return segment_ >= 0 && task_segment_[task] != segment_;
}

bool Scheduler::same_group(int32_t task) const {
  const int32_t group = segment_groups_[segment_];
  const int32_t at = task_segment_[task];
  return group >= 0 && at >= 0 && segment_groups_[at] == group;
}

void Scheduler::begin_segment(int32_t caller, std::optional<int64_t> stream, int32_t group) {
  const auto held = lock();
  if (!running_) {
    throw std::runtime_error("begin_segment() outside a run; call begin_run() first");
  }
  if (segment_caller_ >= 0) {
    throw std::runtime_error("begin_segment() while segment " + std::to_string(segment_) +
                             " is open; call end_segment() first");
  }
  if (caller < 0 || caller >= callers_) {
    throw std::out_of_range("caller slot " + std::to_string(caller) + " out of range");
  }
  const int32_t slot = 2 * stages_ + caller;
  if (stream.has_value() != slots_[slot].spec.stream_id.has_value()) {
    throw std::invalid_argument("caller slot '" + slots_[slot].spec.name +
                                (stream ? "' is a placeholder but got a stream"
                                        : "' needs a stream"));
  }
  // Nothing recorded before can be waited on inside the new capture.
  forget_latest();
  set_caller(slot, stream);
  ++segment_;
  segment_caller_ = slot;
  segment_groups_.push_back(group);
  // The plan names the group in the op's stage (verify_plan orders a
  // group's segments one after another).
  log(OpCode::kBeginSegment, slot, segment_, Who{-1, Kind::kForward, group, -1, -1});
  record(slot, Who{});  // the segment's source
}

void Scheduler::end_segment() {
  const auto held = lock();
  if (segment_caller_ < 0) {
    throw std::runtime_error("end_segment() without an open segment");
  }
  const int32_t c = segment_caller_;
  join_segment();
  log(OpCode::kEndSegment, c, segment_, Who{});
  forget_latest();
  segment_caller_ = -1;
}

void Scheduler::join_segment() {
  const int32_t c = segment_caller_;
  // The caller recorded external events after these slots' latest events:
  // a capture only ends once those records have joined too.
  for (int32_t x = 0; x < static_cast<int32_t>(slots_.size()); ++x) {
    if (external_after_[x]) {
      record(x, Who{});
    }
  }
  std::vector<int32_t> latest;
  for (int32_t x = 0; x < static_cast<int32_t>(slots_.size()); ++x) {
    if (x != c && slots_[x].latest >= 0) {
      latest.push_back(slots_[x].latest);
    }
  }
  wait_all(c, latest);
}

std::vector<std::pair<int32_t, int32_t>> Scheduler::take_crossing() {
  const auto held = lock();
  std::vector<std::pair<int32_t, int32_t>> out;
  out.swap(crossing_);
  return out;
}

int32_t Scheduler::external_record(int32_t task) {
  const auto held = lock();
  if (!running_ || task < 0 || task >= static_cast<int32_t>(schedule_->tasks.size()) ||
      task_event_[task] < 0) {
    throw std::runtime_error("external_record(" + std::to_string(task) +
                             ") of a task that has not ended in this run");
  }
  const Task& t = schedule_->tasks[task];
  const int32_t slot = task_slots(t).second;
  log(OpCode::kXRecord, slot, task, Who{task, t.kind, t.stage, t.peer, t.micro});
  external_after_[slot] = true;
  return slot;
}

int32_t Scheduler::segment() const {
  const auto held = lock();
  return segment_caller_ >= 0 ? segment_ : -1;
}

}  // namespace mpstream
