// What a graphed stage's replays bake in, checked once per run in one call:
// the tensors their graphs read (parameters, buffers) and the gradients
// their graphs add into (see mpstream/runtime/graphed/keys.py and grads.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace mpstream {

// The memory and layout of tensors at construction: a replay reads each
// tensor's memory as it was when captured, so a tensor moved to other memory
// (`.data = ...`, `.to()`), laid out anew (`.t_()`), or switched in
// `requires_grad` invalidates the graphs. In-place updates do not.
class Watch {
 public:
  explicit Watch(std::vector<at::Tensor> tensors);

  // Whether any tensor differs from construction in data pointer, storage
  // offset, sizes, strides, dtype, device or requires_grad.
  bool changed() const;

  // The positions of the tensors that required grad at construction and no
  // longer do: the one change a run can see between a stage's forward and
  // its backward (a freeze in a loss function or a hook), read per backward
  // task, so it reads that one flag and nothing else.
  std::vector<int64_t> frozen() const;

  size_t size() const { return tensors_.size(); }

 private:
  struct Meta {
    const void* data;
    int64_t offset;
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    int8_t dtype;
    int8_t device_type;
    int8_t device_index;
    bool requires_grad;
  };
  static Meta meta_of(const at::Tensor& t);
  static bool same(const at::Tensor& t, const Meta& m);

  std::vector<at::Tensor> tensors_;
  std::vector<Meta> metas_;
};

// Parameters and the gradient views graphs add into (held here, so that a
// check converts nothing from Python).
class Attached {
 public:
  Attached(std::vector<at::Tensor> params, std::vector<at::Tensor> views);

  // The positions i where `params[i].grad` is not `views[i]` itself (None,
  // or another tensor): the parameters whose gradient a graph adding into
  // `views[i]` would not reach.
  std::vector<int64_t> detached() const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> views_;
};

}  // namespace mpstream
