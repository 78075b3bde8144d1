// A per-run check of what graphed stages baked in, in C++ because it runs
// over every parameter and buffer of every stage at every run: a few
// nanoseconds per tensor here, against about a microsecond per tensor for
// the same reads from Python.
#include "watch.h"

#include <c10/util/Exception.h>

namespace mpstream {

Watch::Meta Watch::meta_of(const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "Watch: an undefined tensor");
  Meta m;
  // A tensor without storage (a meta or lazy one) has no pointer to bake in.
  m.data = t.has_storage() ? t.data_ptr() : nullptr;
  m.offset = t.storage_offset();
  m.sizes = t.sizes().vec();
  m.strides = t.layout() == c10::kStrided ? t.strides().vec() : std::vector<int64_t>{};
  m.dtype = static_cast<int8_t>(t.scalar_type());
  m.device_type = static_cast<int8_t>(t.device().type());
  m.device_index = t.device().index();
  m.requires_grad = t.requires_grad();
  return m;
}

bool Watch::same(const at::Tensor& t, const Meta& m) {
  // Compared in place: no copy of sizes or strides per check.
  const void* data = t.has_storage() ? t.data_ptr() : nullptr;
  if (data != m.data || t.storage_offset() != m.offset ||
      static_cast<int8_t>(t.scalar_type()) != m.dtype ||
      static_cast<int8_t>(t.device().type()) != m.device_type ||
      t.device().index() != m.device_index || t.requires_grad() != m.requires_grad ||
      t.sizes() != c10::IntArrayRef(m.sizes)) {
    return false;
  }
  return t.layout() == c10::kStrided ? t.strides() == c10::IntArrayRef(m.strides)
                                     : m.strides.empty();
}

Watch::Watch(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {
  metas_.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    metas_.push_back(meta_of(t));
  }
}

bool Watch::changed() const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!same(tensors_[i], metas_[i])) {
      return true;
    }
  }
  return false;
}

std::vector<int64_t> Watch::frozen() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (metas_[i].requires_grad && !tensors_[i].requires_grad()) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

Attached::Attached(std::vector<at::Tensor> params, std::vector<at::Tensor> views)
    : params_(std::move(params)), views_(std::move(views)) {
  TORCH_CHECK(params_.size() == views_.size(), "Attached: ", params_.size(),
              " parameters but ", views_.size(), " views");
}

std::vector<int64_t> Attached::detached() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (!grad.defined() || grad.unsafeGetTensorImpl() != views_[i].unsafeGetTensorImpl()) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

}  // namespace mpstream
