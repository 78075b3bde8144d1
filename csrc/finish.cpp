// How tasks and runs end: end() records a task's completion (a copy's
// receiving slot after its issuing one) and restores the streams it made
// current; join() orders the callers after every stream's last work and
// releases the run's events; abort() first marks where the open tasks'
// queued kernels end, and then every stream the run used (autograd's own
// work included), so that the callers' next work (restoring state after a
// failure) cannot race with them.
#include <algorithm>
#include <stdexcept>
#include <exception>
#include <string>
#include <thread>

#include "scheduler_impl.h"

namespace mpstream {

void Scheduler::finish_open(Open& o) {
  int32_t done = -1;
  if (o.issue >= 0 && o.issue != o.rec) {
    // A copy runs on its issuing slot; order the receiving slot after it
    // with an event of our own. PyTorch's cross-device copy has a barrier
    // of its own, but a copy between streams of one device has none, and
    // the plan must show every ordering it relies on.
    done = record(o.issue, o.who());
    wait(o.rec, done, o.who());
  }
  if (timing_ && o.timed < 0) {
    timing_mark(o, true);  // timing switched on mid-task
  }
  if (timing_) {
    timing_mark(o, false);
  }
  const int32_t ev = record(o.rec, o.who());
  if (done < 0) {
    done = ev;  // the work ran on the receiving slot itself
  }
  if (o.task >= 0) {
    task_event_[o.task] = ev;
    events_[ev].refs += pending_[o.task];
  } else if (autograd_orders_) {
    // Gradient copy: autograd's engine makes the consumer's stream (stage
    // `stage`'s compute stream) wait on the copy node's stream, the sending
    // copy slot, just before the consumer runs, on the consumer's device
    // thread. Waiting here instead, on this device's thread, could land
    // between another micro-batch's backward kernels on that stream.
    log(OpCode::kAutograd, compute_slot(o.stage), done, o.who());
  } else {
    // Older torch orders the consumer only after its own device's default
    // stream: order it here.
    wait(compute_slot(o.stage), ev, o.who());
  }
  restore_streams(o);
  o.active = false;
}

void Scheduler::end(int64_t handle) {
  const auto held = lock();
  if (handle < 0 || handle >= static_cast<int64_t>(open_.size()) ||
      !(open_[handle]->active || open_[handle]->orphaned)) {
    throw std::invalid_argument("end() got a handle that is not open: " + std::to_string(handle));
  }
  Open& o = *open_[handle];
  if (o.orphaned) {
    // Its run was aborted from another thread, which could not restore
    // this thread's streams: restore them here, then free the handle.
    restore_streams(o);
    o.orphaned = false;
    open_free_.push_back(handle);
    throw std::runtime_error("end() of task " + std::to_string(o.task) +
                             ", whose run another thread aborted; its streams are restored");
  }
  if (o.task >= 0 && !running_) {
    throw std::runtime_error("end() of a scheduled task after its run was aborted");
  }
  if (o.task >= 0) {
    finish_open(o);  // if it throws, the task stays open for abort() to mark its work's end
  } else {
    try {
      finish_open(o);
    } catch (...) {
      // A gradient copy belongs to no run, so abort() leaves it alone (its
      // thread may be copying still): one whose end fails (a sticky device
      // error, a host wait refused in a capture) is closed here, or its
      // handle stays taken and its streams current on this thread for good.
      o.active = false;
      open_free_.push_back(handle);
      restore_streams(o);
      throw;
    }
  }
  open_free_.push_back(handle);
}

void Scheduler::join() {
  const auto held = lock();
  if (!running_) {
    throw std::runtime_error("join() outside a run");
  }
  caller_waits();
  release_run();
}

void Scheduler::caller_waits() {
  const int32_t first_caller = 2 * stages_;
  for (int32_t c = first_caller; c < first_caller + callers_; ++c) {
    std::vector<int32_t> latest;
    for (int32_t x = 0; x < static_cast<int32_t>(slots_.size()); ++x) {
      if (!is_caller(x) && slots_[x].ref == c && slots_[x].latest >= 0) {
        latest.push_back(slots_[x].latest);
      }
    }
    wait_all(c, latest);
  }
}

void Scheduler::wait_all(int32_t slot, const std::vector<int32_t>& events) {
  // Skip an event another candidate was recorded after: waiting on that
  // one implies it.
  for (int32_t e : events) {
    const EventRec& rec = events_[e];
    const bool implied = std::any_of(events.begin(), events.end(), [&](int32_t other) {
      return other != e && events_[other].vc[rec.slot] >= rec.seq;
    });
    if (!implied) {
      wait(slot, e, Who{});
    }
  }
}

void Scheduler::release_run() {
  for (size_t i = 0; i < task_event_.size(); ++i) {
    const int32_t ev = task_event_[i];
    if (ev >= 0) {
      for (; pending_[i] > 0; --pending_[i]) {
        unref(ev);
      }
    }
  }
  for (auto& s : slots_) {
    if (s.latest >= 0) {
      unref(s.latest);
      s.latest = -1;
    }
  }
  task_event_.clear();
  pending_.clear();
  begun_.clear();
  schedule_.reset();
  running_ = false;
}

void Scheduler::abort() {
  const auto held = lock();
  // A device error in here must not keep the rest of the cleanup from
  // running; once it has run, the first one is raised (the caller adds it
  // to the failure that caused the abort). CUDA errors are sticky: hiding
  // one would only move it to the next call, far from its cause.
  std::exception_ptr device_error;
  const auto attempt = [&](auto&& step) {
    try {
      step();
    } catch (const std::exception&) {
      if (!device_error) {
        device_error = std::current_exception();
      }
    }
  };
  std::string foreign;  // tasks another thread opened: its streams are its own
  for (int64_t h = static_cast<int64_t>(open_.size()) - 1; h >= 0; --h) {
    Open& o = *open_[h];
    if (!o.active || o.task < 0) {
      continue;
    }
    if (running_) {
      // Kernels the failed task queued after begin() have no event yet:
      // mark where they end, as end() would (a copy's receiving stream
      // after its issuing one), so that the callers wait for them below.
      attempt([&] {
        if (o.issue >= 0 && o.issue != o.rec) {
          const int32_t done = record(o.issue, o.who());
          wait(o.rec, done, o.who());
        }
        record(o.rec, o.who());
      });
    }
    o.active = false;
    if (o.thread == std::this_thread::get_id()) {
      restore_streams(o);
      open_free_.push_back(h);
    } else {
      // Current streams are per thread: restoring here would change this
      // thread's, and leave the opener's as the task set them. The handle
      // stays the opener's until its end() restores them (no new task may
      // take it meanwhile).
      o.orphaned = true;
      foreign += (foreign.empty() ? "" : ", ") + std::to_string(o.task);
    }
  }
  if (running_) {
    // Work already queued by the failed run may still be running; the
    // caller's next work (restoring state, say) must come after it.
    // Autograd may have queued work no task of ours marks on a stream the
    // run used (a tied weight's gradient is summed on the stream of its
    // first use, before the backward failed elsewhere): mark each one's
    // end, so the callers wait for it all.
    for (int32_t x = 0; x < static_cast<int32_t>(slots_.size()); ++x) {
      if (!is_caller(x) && slots_[x].latest >= 0) {
        attempt([&] { record(x, Who{}); });
      }
    }
    attempt([&] { caller_waits(); });
    attempt([&] { drop_run_timings(); });  // its harvest queries events
    release_run();
  }
  if (device_error) {
    std::rethrow_exception(device_error);
  }
  if (!foreign.empty()) {
    throw std::runtime_error(
        "abort() ran on another thread than the one that began task(s) " + foreign +
        ": their streams stay current on that thread; abort a run from the thread that "
        "issues it");
  }
}

}  // namespace mpstream
