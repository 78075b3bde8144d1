// The hooks of an autograd node set aside while a zero-bubble weight pass
// (W) starts autograd there again (see mpstream/runtime/split_hooks.py).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/utils/pybind.h>

#include <iterator>
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

// The node behind a `torch.autograd.graph.Node` object, with its owner
// (see `hold`). `who` names the caller in the errors: TypeError for
// anything but a node, ValueError for a node already freed.
std::pair<std::shared_ptr<void>, torch::autograd::Node*> node_of(const pybind11::handle& node,
                                                                 const char* who);

// Puts the hooks set aside back ahead of those the node gained meanwhile
// (a hook registering another, W's own prehook), and empties `kept`.
template <typename Hooks>
void give_back(Hooks& kept, Hooks& now) {
  kept.insert(kept.end(), std::make_move_iterator(now.begin()),
              std::make_move_iterator(now.end()));
  now.clear();
  std::swap(kept, now);
}

}  // namespace detail

// Takes every hook a node runs before or after its backward off it until
// `restore()`, keeping the node alive meanwhile: its tensor hooks
// (`tensor_pre_hooks()`: `Tensor.register_hook`'s on its outputs, each
// output's dict of Python hooks or a C++ hook list), its prehooks
// (`pre_hooks()`: `Node.register_prehook`'s, one dict of Python hooks) and
// its posthooks (`post_hooks()`: `Node.register_hook`'s, and the deprecated
// `Module.register_backward_hook`'s). `retain_grad`'s hooks
// (`retains_grad_hooks()`) stay.
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

  // Gives the node its hooks back, each kind ahead of any the node gained
  // meanwhile; once (later calls do nothing).
  void restore();

  // How many hooks are set aside (0 once restored): a holder of Python
  // hooks (one per output for tensor hooks, one per node for prehooks and
  // for posthooks) counts once.
  size_t size() const { return tensor_pre_.size() + pre_.size() + post_.size(); }

 private:
  std::shared_ptr<void> owner_;  // keeps node_ alive until restore()
  torch::autograd::Node* node_ = nullptr;
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> tensor_pre_;
  std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> pre_;
  std::vector<std::unique_ptr<torch::autograd::FunctionPostHook>> post_;
};

// Whether `node` (as for MutedHooks) holds posthooks. Python's holder stays
// once its hooks are removed: a node that had one counts.
bool has_post_hooks(const pybind11::handle& node);

}  // namespace mpstream
