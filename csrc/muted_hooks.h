// Tensor hooks of an autograd node set aside while a zero-bubble weight pass
// (W) starts autograd there again (see mpstream/runtime/split_hooks.py).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpstream {

namespace detail {

// The Python objects of autograd nodes point at their C++ node with an
// owning intrusive_ptr in recent torch releases, but with a shared_ptr
// (THPCppFunction) or a weak_ptr (THPFunction) in older ones: `strong`
// turns any of them into an owning pointer, null if the node is gone.
template <typename T>
std::shared_ptr<T> strong(const std::weak_ptr<T>& p) {
  return p.lock();
}

template <typename P>
P strong(const P& p) {
  return p;
}

// A type-erased owner of the node behind `p` (shared_ptr, intrusive_ptr or
// weak_ptr to Node or a subclass), with the node; both null if it is gone.
template <typename P>
std::pair<std::shared_ptr<void>, torch::autograd::Node*> hold(const P& p) {
  auto owner = strong(p);
  torch::autograd::Node* node = owner.get();
  if (node == nullptr) {
    return {nullptr, nullptr};
  }
  return {std::make_shared<std::decay_t<decltype(owner)>>(std::move(owner)), node};
}

}  // namespace detail

// Takes a node's tensor hooks (its `tensor_pre_hooks()`: the hooks of
// `Tensor.register_hook` on its outputs, each output's dict of Python hooks
// or a C++ hook list) off it until `restore()`, keeping the node alive
// meanwhile. Its other hooks stay: `retain_grad`'s (`retains_grad_hooks()`)
// and the node's prehooks and posthooks.
class MutedHooks {
 public:
  // `node`: a `torch.autograd.graph.Node` (a tensor's `grad_fn`, a
  // GradientEdge's `node`), of a built-in operator or a custom
  // `autograd.Function`. Throws TypeError for anything else, ValueError for
  // a node already freed.
  explicit MutedHooks(const pybind11::handle& node);
  ~MutedHooks();
  MutedHooks(const MutedHooks&) = delete;
  MutedHooks& operator=(const MutedHooks&) = delete;

  // Gives the node its hooks back, ahead of any it gained meanwhile; once
  // (later calls do nothing).
  void restore();

  // How many hooks are set aside (0 once restored).
  size_t size() const { return hooks_.size(); }

 private:
  std::shared_ptr<void> owner_;  // keeps node_ alive until restore()
  torch::autograd::Node* node_ = nullptr;
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> hooks_;
};

}  // namespace mpstream
