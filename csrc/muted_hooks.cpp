// MutedHooks: see muted_hooks.h.
#include "muted_hooks.h"

#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#include <iterator>
#include <string>

namespace mpstream {

MutedHooks::MutedHooks(const pybind11::handle& node) {
  PyObject* obj = node.ptr();
  std::pair<std::shared_ptr<void>, torch::autograd::Node*> held;
  if (torch::autograd::THPCppFunction_Check(obj)) {
    held = detail::hold(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  } else if (THPFunction_Check(obj)) {
    held = detail::hold(reinterpret_cast<THPFunction*>(obj)->cdata);
  } else {
    throw pybind11::type_error(
        std::string("MutedHooks takes an autograd node (a tensor's grad_fn, or a "
                    "GradientEdge's node), not ") +
        Py_TYPE(obj)->tp_name);
  }
  if (held.second == nullptr) {
    throw pybind11::value_error(
        "MutedHooks: this autograd node was freed (its graph was released)");
  }
  owner_ = std::move(held.first);
  node_ = held.second;
  std::swap(hooks_, node_->tensor_pre_hooks());
}

MutedHooks::~MutedHooks() { restore(); }

void MutedHooks::restore() {
  if (node_ == nullptr) {
    return;
  }
  auto& now = node_->tensor_pre_hooks();
  // A tensor given its first hook while muted (a hook registering another)
  // keeps it, after the hooks registered before.
  hooks_.insert(hooks_.end(), std::make_move_iterator(now.begin()),
                std::make_move_iterator(now.end()));
  now.clear();
  std::swap(hooks_, now);
  node_ = nullptr;
  owner_.reset();  // may free the node, and with it the graph below
}

}  // namespace mpstream
