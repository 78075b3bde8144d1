// Pipeline schedules as ordered task lists with explicit data dependencies.
//
// A schedule is the order in which one host thread issues work. Each task
// names the earlier tasks whose outputs it reads; the scheduler turns those
// edges into CUDA event waits, so the order here only decides *when* work is
// enqueued, never whether it is correct.
//
// Stages form a graph, not only a chain: stage s reads the outputs of any
// earlier stages (a skip connection reads one several stages back) and the
// pipeline's input. A value crosses to another device once per receiving
// device, in a copy task shared by every stage there that reads it, and its
// gradient comes back the same way.
//
// A backward may be split in two (zero-bubble schedules): the backward task
// then computes only the gradients of the stage's inputs, which the stages
// before it wait for, and a weight task of its own computes the gradients of
// the stage's parameters later, filling time the pipeline would idle.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mpstream {

enum class Kind : int8_t {
  kForward = 0,   // stage `stage` computes micro-batch `micro`
  kBackward = 1,  // stage `stage` back-propagates micro-batch `micro`
  kCopy = 2,      // output of `stage` (-1: the input) moves to stage `peer`'s device
  kCopyGrad = 3,  // gradient of that value moves back from `peer`'s device to `stage`
  kTarget = 4,    // the target of micro-batch `micro` moves to the last stage
  kWeight = 5,    // stage `stage`'s parameter gradients of micro-batch `micro`
                  // (its backward task then computed the input gradients only)
};

const char* kind_name(Kind kind);

struct Task {
  int32_t index = 0;
  Kind kind = Kind::kForward;
  int32_t stage = 0;
  int32_t micro = 0;
  // For copies and gradient copies: the first stage on the receiving device
  // that reads the value (its copy stream receives it); else `stage`.
  int32_t peer = 0;
  std::vector<int32_t> deps;  // indices of tasks whose outputs this one reads
};

// The stage graph and where data moves. reads[s] lists the stages whose
// outputs stage s reads (-1: the pipeline's input), in increasing order;
// the last stage also reads every stage the pipeline's output comes from.
// device[s] labels stage s's device (equal labels, same device) and
// input_device the input's. A read crosses devices, and needs a copy task,
// when the labels differ, or always between stages with force_copies (then
// each reading stage gets its own copy, as if every stage had a device).
// copy_target: a training step's targets are not on the last stage's
// device, so each micro-batch's target moves there in a task of its own,
// issued with the input copies.
struct Layout {
  int32_t stages = 0;
  int32_t micros = 0;
  std::vector<std::vector<int32_t>> reads;
  std::vector<int32_t> device;
  int32_t input_device = 0;
  bool force_copies = false;
  bool copy_target = false;
  // Stages per pipeline rank, read by the schedules that place several
  // stages on a rank: round-robin ones (interleaved 1F1B, interleaved
  // zero-bubble, looped BFS) put stage s on rank s mod (stages /
  // virtual_stages); V ones (ZB-V, DualPipe-V) need 2 and put stage s on
  // rank min(s, stages - 1 - s). 1 means a rank per stage.
  int32_t virtual_stages = 1;
};

// One compute step of an issue order: a forward, a backward or a weight
// task (kind is kForward, kBackward or kWeight) of a stage and micro-batch.
// Copies are implied: the builder issues them around the compute.
struct Action {
  Kind kind = Kind::kForward;
  int32_t stage = 0;
  int32_t micro = 0;
};

// What is wrong with an issue order: the step (index into the actions) it
// concerns, -1 when none does (a missing action), and why.
struct OrderProblem {
  int32_t step = -1;
  std::string message;
};

struct Schedule {
  std::string name;
  Layout layout;
  std::vector<Task> tasks;
  // Tasks the caller consumes at the end of a run (the last stage's outputs
  // for a forward).
  std::vector<int32_t> outputs;
};

// A chain of stages: stage s reads stage s - 1; copy_in[s] says whether that
// read (copy_in[0]: the input) crosses devices.
Layout chain_layout(int32_t micros, const std::vector<bool>& copy_in);

// Throws std::invalid_argument unless the layout is consistent: at least
// one stage and micro-batch, at most 2^24 (stage, micro-batch) pairs, and
// every stage reading earlier stages only.
void check_layout(const Layout& layout);

// Names accepted by make_schedule.
std::vector<std::string> schedule_names();

// Each built-in schedule's name and the placement of stages on ranks it
// needs: "stage" (a rank per stage, any devices), "round_robin" (stage s on
// rank s mod ranks) or "v" (two stages per rank, stage s on rank
// min(s, stages - 1 - s)).
std::vector<std::pair<std::string, std::string>> schedule_placements();

// Builds a built-in schedule (one of schedule_names()) for the layout.
// `backward` adds the backward tasks to "gpipe" (explicitly scheduled
// training); the others always have them.
Schedule make_schedule(const std::string& name, const Layout& layout, bool backward);

// The first problem of an explicit issue order (none: step -1, empty
// message): every forward and backward of every stage and micro-batch
// exactly once, weight tasks at most once each, and each action after the
// actions it depends on, so one host thread issuing them in order never
// waits for work it has not issued.
OrderProblem check_order(const Layout& layout, const std::vector<Action>& actions);

// Builds the schedule that issues `actions` in order (named "custom").
// Throws std::invalid_argument with check_order's message for a bad order.
Schedule make_ordered_schedule(const Layout& layout, const std::vector<Action>& actions);

// The text form of an action: F0m3, B1m2, W1m2.
std::string action_name(const Action& action);

}  // namespace mpstream
