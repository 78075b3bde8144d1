// Pipeline schedules as ordered task lists with explicit data dependencies.
//
// A schedule is the order in which one host thread issues work. Each task
// names the earlier tasks whose outputs it reads; the scheduler turns those
// edges into CUDA event waits, so the order here only decides *when* work is
// enqueued, never whether it is correct.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mpstream {

enum class Kind : int8_t {
  kForward = 0,   // stage `stage` computes micro-batch `micro`
  kBackward = 1,  // stage `stage` back-propagates micro-batch `micro`
  kCopy = 2,      // output of `stage` moves to `stage + 1` (-1: the input)
  kCopyGrad = 3,  // gradient of `stage + 1`'s input moves back to `stage`
  kTarget = 4,    // the target of micro-batch `micro` moves to the last stage
};

const char* kind_name(Kind kind);

struct Task {
  int32_t index = 0;
  Kind kind = Kind::kForward;
  int32_t stage = 0;
  int32_t micro = 0;
  std::vector<int32_t> deps;  // indices of tasks whose outputs this one reads
};

// Which stage boundaries move data between devices. copy_in[s] is true when
// stage s receives its input through a copy (copy_in[0]: the batch itself is
// not on stage 0's device). Same-device boundaries need no copy task: the
// consumer waits directly on the producer's event. copy_target: a training
// step's targets are not on the last stage's device, so each micro-batch's
// target moves there in a task of its own, issued with the input copies.
struct Layout {
  int32_t stages = 0;
  int32_t micros = 0;
  std::vector<bool> copy_in;
  bool copy_target = false;
};

struct Schedule {
  std::string name;
  Layout layout;
  std::vector<Task> tasks;
  // Tasks the caller consumes at the end of a run (the last stage's outputs
  // for a forward; the last backward per stage for a training step).
  std::vector<int32_t> outputs;
};

// Names accepted by make_schedule.
std::vector<std::string> schedule_names();

// Builds `name` ("gpipe" or "1f1b") for the layout. `backward` adds the
// backward tasks (explicitly scheduled training); "1f1b" always has them.
Schedule make_schedule(const std::string& name, const Layout& layout, bool backward);

}  // namespace mpstream
