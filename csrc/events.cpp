// The event pool and stream ordering: acquiring and recycling events,
// recording them, and making slots wait.
//
// Ordering is tracked with vector clocks: every slot counts its records and
// remembers, per other slot, the newest record it has already waited on
// (directly or through a chain of waits). A wait that is already implied is
// skipped, so a stage stream waits on the caller's source event once per run
// and never twice on the same producer.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "scheduler_impl.h"

namespace mpstream {

const char* op_name(OpCode op) {
  switch (op) {
    case OpCode::kWait:
      return "wait";
    case OpCode::kRecord:
      return "record";
    case OpCode::kRun:
      return "run";
    case OpCode::kSync:
      return "sync";
    case OpCode::kAutograd:
      return "autograd";
  }
  return "unknown";
}

namespace detail {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

c10::Stream make_stream(const SlotSpec& spec) {
  return c10::Stream::unpack3(*spec.stream_id, spec.device_index,
                              static_cast<c10::DeviceType>(spec.device_type));
}

std::optional<c10::Stream> exchange(const std::optional<c10::Stream>& stream) {
  if (!stream) {
    return std::nullopt;
  }
  c10::impl::VirtualGuardImpl impl(stream->device_type());
  return impl.exchangeStream(*stream);
}

void restore(const std::optional<c10::Stream>& prev) {
  if (prev) {
    c10::impl::VirtualGuardImpl impl(prev->device_type());
    impl.exchangeStream(*prev);
  }
}

std::optional<c10::Device> exchange_device(const std::optional<c10::Stream>& stream) {
  if (!stream) {
    return std::nullopt;
  }
  c10::impl::VirtualGuardImpl impl(stream->device_type());
  return impl.exchangeDevice(stream->device());
}

void restore_device(const std::optional<c10::Device>& prev) {
  if (prev) {
    c10::impl::VirtualGuardImpl impl(prev->type());
    impl.setDevice(*prev);
  }
}

}  // namespace detail

int32_t Scheduler::take_event(int32_t slot) {
  const int32_t pool = slots_[slot].pool;
  auto& free = free_[pool];
  if (!free.empty()) {
    const int32_t id = free.back();
    free.pop_back();
    return id;
  }
  EventRec rec;
  rec.pool = pool;
  events_.push_back(std::move(rec));
  return static_cast<int32_t>(events_.size() - 1);
}

const Scheduler::EventRec& Scheduler::held_event(int32_t event) const {
  const EventRec& rec = events_[event];
  if (rec.refs <= 0) {
    // Back in the pool, it may be recorded again for another task: its
    // clock would order the wrong work.
    throw std::logic_error("mpstream internal error: event " + std::to_string(event) +
                           " was read after it went back to the pool");
  }
  return rec;
}

void Scheduler::unref(int32_t event) {
  auto& rec = events_[event];
  if (--rec.refs == 0) {
    free_[rec.pool].push_back(event);
  }
}

void Scheduler::log(OpCode op, int32_t slot, int32_t event, const Who& who) {
  if (recording_) {
    plan_.push_back(PlanOp{op, slot, event, who});
  }
}

int32_t Scheduler::record(int32_t slot, const Who& who) {
  Slot& s = slots_[slot];
  const int32_t id = take_event(slot);
  EventRec& rec = events_[id];
  rec.slot = slot;
  rec.seq = s.vc[slot] + 1;
  rec.vc = s.vc;
  rec.vc[slot] = rec.seq;
  if (s.stream) {
    try {
      if (!rec.event) {
        rec.event.emplace(s.stream->device_type());
      }
      rec.event->record(*s.stream);
    } catch (...) {
      free_[rec.pool].push_back(id);  // a failed record (a device error) holds no event
      throw;
    }
  }
  s.vc[slot] = rec.seq;  // counted once it is recorded
  rec.refs = 1;  // held as the slot's latest
  if (s.latest >= 0) {
    unref(s.latest);
  }
  s.latest = id;
  log(OpCode::kRecord, slot, id, who);
  return id;
}

void Scheduler::host_wait(const c10::Event& event) const {
  if (host_wait_) {
    host_wait_(event);
  } else {
    event.synchronize();
  }
}

void Scheduler::wait(int32_t slot, int32_t event, const Who& who) {
  const EventRec& rec = events_[event];
  Slot& s = slots_[slot];
  if (rec.slot == slot || s.vc[rec.slot] >= rec.seq) {
    return;  // same stream, or already ordered through an earlier wait
  }
  OpCode op = OpCode::kWait;
  if (rec.event && s.stream) {
    rec.event->block(*s.stream);
  } else if (rec.event) {
    // Placeholder consumer (host work) after device work: block the host,
    // which a capture cannot hold (the work it would wait for is not run).
    if (capturing_) {
      throw std::runtime_error(
          "'" + s.spec.name + "' (host work) would wait for device work recorded on '" +
          slots_[rec.slot].spec.name +
          "' while a CUDA graph captures: the captured work has not run, so the host would "
          "read stale memory; keep every stage of a captured step on CUDA");
    }
    host_wait(*rec.event);
    op = OpCode::kSync;
  }
  for (size_t i = 0; i < s.vc.size(); ++i) {
    s.vc[i] = std::max(s.vc[i], rec.vc[i]);
  }
  log(op, slot, event, who);
}

}  // namespace mpstream
