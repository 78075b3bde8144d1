// Private parts of the Scheduler shared by its implementation files.
#pragma once

#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "scheduler.h"

namespace mpstream {

struct Scheduler::Slot {
  SlotSpec spec;
  std::optional<c10::Stream> stream;
  int32_t pool = 0;
  int32_t ref = 0;  // caller slot (index into slots_) of this slot's device
  std::vector<int64_t> vc;
  int32_t latest = -1;  // newest event recorded here during this run
};

struct Scheduler::EventRec {
  int32_t pool = 0;
  std::optional<c10::Event> event;  // device pools only, made at first record
  int32_t slot = -1;
  int64_t seq = 0;
  std::vector<int64_t> vc;
  int32_t refs = 0;
};

struct Scheduler::TimedTask {
  Kind kind;
  int32_t stage;
  int32_t peer;
  int32_t micro;
  int32_t slot;
  int32_t start_slot;
  int32_t start = -1;  // pooled timing events (device slots), -1 for none
  int32_t end = -1;
  int64_t host_start_ns = 0;
  int64_t host_end_ns = 0;
  int64_t issue_start_ns = 0;  // the issuing thread's clock, on every slot
  int64_t issue_end_ns = 0;
  double start_ms = 0;
  double end_ms = 0;
  int64_t run = 0;
  bool done = false;
  bool resolved = false;
  bool dropped = false;  // its run failed: timings() leaves it out
};

struct Scheduler::Open {
  int32_t task = -1;  // -1: a gradient copy outside the schedule
  Kind kind = Kind::kForward;
  int32_t stage = 0;
  int32_t peer = 0;
  int32_t micro = 0;
  int32_t issue = -1;
  int32_t rec = -1;
  std::optional<c10::Stream> prev_issue;
  std::optional<c10::Stream> prev_rec;
  std::optional<c10::Device> prev_device;
  int32_t timed = -1;
  int64_t timed_generation = 0;  // a clear_timings in between voids `timed`
  bool active = false;
  std::thread::id thread;  // which thread's current streams the task changed
  bool orphaned = false;   // aborted from another thread: its end() restores them

  Who who() const { return Who{task, kind, stage, peer, micro}; }
};

namespace detail {

int64_t now_ns();
c10::Stream make_stream(const SlotSpec& spec);
std::optional<c10::Stream> exchange(const std::optional<c10::Stream>& stream);
void restore(const std::optional<c10::Stream>& prev);
// Makes the stream's device current (device streams only); returns the
// previous device for restore_device.
std::optional<c10::Device> exchange_device(const std::optional<c10::Stream>& stream);
void restore_device(const std::optional<c10::Device>& prev);

}  // namespace detail
}  // namespace mpstream
