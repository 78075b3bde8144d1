// The event scheduler: turns a schedule's data dependencies into stream waits
// and records, with pooled events, an optional log of every stream operation
// (the plan) and optional per-task timing.
//
// Streams live in slots: slot 2s is stage s's compute stream, slot 2s + 1 its
// copy stream; then one caller slot per device, the stream the user was on
// when the run started; then one io slot per device, the stream that moves
// the batch in from the host (inputs, targets) so those transfers never queue
// behind inter-stage copies. A slot without a stream is a placeholder: its
// work runs on the host in issue order, so waits on it are bookkeeping only.
// With every slot a placeholder the scheduler runs on no device at all and
// the plan shows what it would issue (recording mode).
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "schedule.h"

namespace mpstream {

struct SlotSpec {
  int8_t device_type = 0;   // c10::DeviceType as an integer
  int8_t device_index = -1;
  std::optional<int64_t> stream_id;  // none: placeholder
  std::string name;
};

enum class OpCode : int8_t {
  kWait = 0,    // slot waits on an event recorded on another slot
  kRecord = 1,  // event recorded on slot
  kRun = 2,     // the task's own work is issued on slot
  kSync = 3,    // the host blocks on an event (placeholder consumer)
  kAutograd = 4,  // autograd's engine makes slot wait on event before the
                  // consumer of a gradient copy runs (logged, not issued)
};

const char* op_name(OpCode op);

// Which work an operation belongs to: a task of the run's schedule (or -1
// outside one: the source, the join, autograd's gradient copies).
struct Who {
  int32_t task = -1;
  Kind kind = Kind::kForward;
  int32_t stage = -1;
  int32_t peer = -1;
  int32_t micro = -1;
};

struct PlanOp {
  OpCode op;
  int32_t slot;
  int32_t event;  // -1 for kRun
  Who who;
};

struct Timing {
  Kind kind;
  int32_t stage;
  int32_t peer;
  int32_t micro;
  int32_t slot;
  double start_ms;
  double end_ms;
  int64_t run;     // which run (begin_run call since timing was cleared)
  double issue_ms;  // host time between the task's begin and end: issuing it
};

class Scheduler {
 public:
  // stage_slots: two per stage (compute, copy). caller_slots: one per device.
  // caller_of_stage[s]: index into caller_slots for stage s's device.
  // io_slots: one per caller slot, on the same device.
  Scheduler(std::vector<SlotSpec> stage_slots, std::vector<SlotSpec> caller_slots,
            std::vector<int32_t> caller_of_stage, std::vector<SlotSpec> io_slots);
  ~Scheduler();

  int32_t num_stages() const { return stages_; }
  std::vector<SlotSpec> slots() const;

  // Starts a run of `schedule`; caller_streams gives the user's current
  // stream id per caller slot (none for placeholders). Records one source
  // event per caller slot: every stage stream waits on it before its first
  // task, so work the user enqueued earlier (an optimizer step) is visible.
  void begin_run(std::shared_ptr<const Schedule> schedule,
                 const std::vector<std::optional<int64_t>>& caller_streams);
  // Waits on the task's dependencies, makes its streams current and returns
  // a handle for end().
  int64_t begin(int32_t task);
  // Records the task's completion event and restores the previous streams.
  void end(int64_t handle);
  // Every caller slot waits on the latest work of every slot on its device.
  // Ends the run and returns all run events to the pool.
  void join();
  // Ends a failed run: records an event on the streams of every task still
  // open (work it queued after begin() has no event otherwise), makes the
  // caller's streams wait on everything the run queued, restores the streams
  // and releases all events. Safe to call at any time; the next run starts
  // clean. Then raises the first device error met on the way (a sticky CUDA
  // error), or, when another thread began a task still open, says that its
  // streams could not be restored from here.
  void abort();
  bool running() const;

  // A gradient copy issued by autograd outside the schedule: the gradient of
  // the value stage `stage` sent to stage `peer`'s device moves back to
  // `stage`. The copy runs on the stream
  // of the forward copy's autograd node (the sending copy slot across
  // devices, the receiving one on one device). Stage `stage`'s compute
  // stream must wait for it before the
  // consumer's kernels: autograd's engine does that itself, right before it
  // runs the consumer, when `autograd_orders_grad_copies` is set (torch >=
  // 2.8); otherwise end() issues the wait, from the sending device's thread.
  int64_t begin_grad_copy(int32_t stage, int32_t peer, int32_t micro);
  void set_autograd_orders_grad_copies(bool on);
  bool autograd_orders_grad_copies() const;

  // Whether a CUDA graph is capturing this scheduler's streams (set by the
  // code that captures: c10 cannot tell). While it is, a host wait on device
  // work (a placeholder slot after a device slot) and timing are refused:
  // neither can be held in a graph.
  void set_capturing(bool on);
  bool capturing() const;

  // Recording of every stream operation.
  void set_recording(bool on);
  bool recording() const;
  std::vector<PlanOp> plan() const;
  void clear_plan();

  // Per-task timing: device events on streams, host clock on placeholders.
  // Switching timing on records the reference events (one per device, on
  // the caller's streams) if there are none yet. Timing events come from a
  // pool: each run's begin_run turns the finished tasks' events into times
  // and returns them, so only work still in flight holds events.
  // abort() drops the failed run's timings: timings() holds whole runs.
  void set_timing(bool on);
  bool timing() const;
  std::vector<Timing> timings();  // blocks until the timed work finished
  void clear_timings();
  // Times work the scheduler does not issue itself: a stage's backward run
  // by autograd. begin_mark records a start on the stage's compute slot (the
  // caller must have that stream current, as autograd does for the stage's
  // nodes); end_mark the end. Returns -1 (and end_mark ignores it) when
  // timing is off. `run_tag`, run_tag() when the work was issued, names the
  // run the mark belongs to (-1: the latest run), so that autograd's
  // backward of a forward run counts in that run, whatever ran since.
  // end_mark ignores a mark that has ended already and throws
  // std::invalid_argument for a number begin_mark did not return.
  int64_t begin_mark(Kind kind, int32_t stage, int32_t micro, int64_t run_tag = -1);
  void end_mark(int64_t mark);
  // The latest run, as begin_mark's run_tag takes it.
  int64_t run_tag() const;

  // Pool introspection, for tests: events ever created, and free now.
  int64_t events_created() const;
  int64_t events_free() const;
  int64_t timing_events_created() const;

  // Called with the (unlocked) lock when another thread holds the
  // scheduler; must lock it. The Python bindings release the GIL here, so
  // no thread ever waits for the scheduler while holding the GIL.
  using ContentionHook = void (*)(std::unique_lock<std::mutex>&);
  void set_contention_hook(ContentionHook hook) { contention_ = hook; }
  // Called to block the host on a device event (host work after device
  // work, timings()); must synchronize it. It runs with the scheduler's
  // mutex held. The Python bindings release the GIL here: the wait lasts
  // as long as the device work queued before the event and touches no
  // Python object, and the contention hook keeps a thread that then takes
  // the GIL from waiting for the mutex with it.
  using HostWaitHook = void (*)(const c10::Event&);
  void set_host_wait_hook(HostWaitHook hook) { host_wait_ = hook; }

 private:
  struct Slot;
  struct EventRec;
  struct Open;
  struct TimedTask;

  int32_t compute_slot(int32_t stage) const { return 2 * stage; }
  int32_t copy_slot(int32_t stage) const { return 2 * stage + 1; }
  int32_t caller_slot(int32_t stage) const;
  int32_t io_slot(int32_t stage) const;
  bool is_caller(int32_t slot) const {
    return slot >= 2 * stages_ && slot < 2 * stages_ + callers_;
  }
  bool same_device(int32_t a, int32_t b) const;
  // (issue slot or -1, record slot) of a scheduled task.
  std::pair<int32_t, int32_t> task_slots(const Task& t) const;
  // The slot a task's waits go to: where its work is issued.
  int32_t wait_slot(const Task& t) const;

  int32_t take_event(int32_t slot);  // a free event of the slot's pool, or a new one
  void unref(int32_t event);
  // An event some run still holds (refs > 0); throws on one back in the pool.
  const EventRec& held_event(int32_t event) const;
  int32_t record(int32_t slot, const Who& who);
  void wait(int32_t slot, int32_t event, const Who& who);
  void log(OpCode op, int32_t slot, int32_t event, const Who& who);
  int64_t open(const Who& who, int32_t issue, int32_t rec);
  void finish_open(Open& o);
  void restore_streams(Open& o);
  void release_run();
  void caller_waits();  // every caller slot after every slot on its device
  // `slot` waits on each of `events` that no other of them implies.
  void wait_all(int32_t slot, const std::vector<int32_t>& events);
  void host_wait(const c10::Event& event) const;
  void ensure_reference();
  void timing_mark(Open& o, bool start);
  int32_t take_timing_event(int32_t slot);
  // Turns a finished task's events into times and returns them to the pool;
  // without `wait`, only if they have completed. Returns whether resolved.
  bool resolve(TimedTask& t, bool wait);
  void harvest_timings();
  void drop_run_timings();  // abort(): the failed run's timings

  int32_t stages_ = 0;
  int32_t callers_ = 0;
  std::vector<Slot> slots_;
  std::vector<int32_t> caller_of_stage_;
  std::vector<EventRec> events_;
  std::vector<std::vector<int32_t>> free_;  // per pool key
  std::vector<std::unique_ptr<Open>> open_;
  std::vector<int64_t> open_free_;

  std::shared_ptr<const Schedule> schedule_;
  std::vector<int32_t> task_event_;
  std::vector<int32_t> pending_;
  std::vector<uint8_t> begun_;  // per task of the run: begin() took it
  bool running_ = false;

  bool recording_ = false;
  bool capturing_ = false;
  std::vector<PlanOp> plan_;
  bool autograd_orders_ = false;

  bool timing_ = false;
  bool have_reference_ = false;
  std::chrono::steady_clock::time_point host_t0_;
  std::vector<std::optional<c10::Event>> reference_;  // per caller slot
  std::vector<TimedTask> timed_;
  size_t unresolved_from_ = 0;  // timed_[i] for i below this are resolved
  std::vector<std::optional<c10::Event>> timing_events_;
  std::vector<int32_t> timing_event_pool_;  // pool key of each timing event
  std::vector<std::vector<int32_t>> timing_free_;  // per pool key
  int64_t runs_ = 0;  // begin_run calls since timing was cleared
  int64_t timing_generation_ = 0;  // bumped by clear_timings

  // Takes the scheduler's mutex (through the contention hook when another
  // thread holds it).
  std::unique_lock<std::mutex> lock() const;

  mutable std::mutex mu_;
  ContentionHook contention_ = nullptr;
  HostWaitHook host_wait_ = nullptr;
};

}  // namespace mpstream
