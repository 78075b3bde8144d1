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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mpstream {

enum class Kind : int8_t {
  kForward = 0,   // stage `stage` computes micro-batch `micro`
  kBackward = 1,  // stage `stage` back-propagates micro-batch `micro`
  kCopy = 2,      // output of `stage` (-1: the input) moves to stage `peer`'s device
  kCopyGrad = 3,  // gradient of that value moves back from `peer`'s device to `stage`
  kTarget = 4,    // the target of micro-batch `micro` moves to the last stage
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

// Names accepted by make_schedule.
std::vector<std::string> schedule_names();

// Builds `name` ("gpipe" or "1f1b") for the layout. `backward` adds the
// backward tasks (explicitly scheduled training); "1f1b" always has them.
Schedule make_schedule(const std::string& name, const Layout& layout, bool backward);

}  // namespace mpstream
