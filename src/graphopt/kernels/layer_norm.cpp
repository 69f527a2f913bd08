// CPU kernels of graphopt::add_layer_norm and graphopt::skip_layer_norm: a residual
// add and the LayerNorm after it in one pass over each row (ONNX Runtime's
// SkipLayerNormalization). Built by layer_norm.py with torch's JIT C++ extension
// loader for the machine's vector ISA; loading the library registers them for the
// CPU dispatch key, so a host graph's replay calls them without entering Python.
//
// Eager code writes the sum to memory, and LayerNorm reads it back twice (its
// moments, then the normalisation). Here each row's sum is made while the row is in
// the cache and normalised there: about half the memory traffic and one kernel call
// less. The moments are computed in two passes (mean, then centred squares), as
// precise as torch's own kernel. float32 only: other dtypes run torch's add and
// LayerNorm (the fusion pass does not make the op for them).

// ATen and the op registry only: torch/extension.h adds the whole C++ frontend and
// pybind, three times the compile time of this file.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// sum_out = x + residual, out = LayerNorm(sum_out) * weight + bias, for one row of n.
void row(const float* x, const float* residual, const float* weight, const float* bias, float eps, int64_t n,
         float* sum_out, float* out) {
  Vec total(0.f);
  int64_t k = 0;
  for (; k + Vec::size() <= n; k += Vec::size()) {
    const Vec s = Vec::loadu(x + k) + Vec::loadu(residual + k);
    s.store(sum_out + k);
    total = total + s;
  }
  float sum = reduce_sum(total);
  for (; k < n; ++k) {
    sum_out[k] = x[k] + residual[k];
    sum += sum_out[k];
  }
  const float mean = sum / n;
  const Vec mean_v(mean);
  Vec squares(0.f);
  for (k = 0; k + Vec::size() <= n; k += Vec::size()) {
    const Vec c = Vec::loadu(sum_out + k) - mean_v;
    squares = at::vec::fmadd(c, c, squares);
  }
  float variance = reduce_sum(squares);
  for (; k < n; ++k) {
    variance += (sum_out[k] - mean) * (sum_out[k] - mean);
  }
  const float rstd = 1.f / std::sqrt(variance / n + eps);
  const Vec rstd_v(rstd);
  for (k = 0; k + Vec::size() <= n; k += Vec::size()) {
    Vec v = (Vec::loadu(sum_out + k) - mean_v) * rstd_v;
    if (weight) {
      v = v * Vec::loadu(weight + k);
    }
    if (bias) {
      v = v + Vec::loadu(bias + k);
    }
    v.store(out + k);
  }
  for (; k < n; ++k) {
    float v = (sum_out[k] - mean) * rstd;
    out[k] = (weight ? v * weight[k] : v) + (bias ? bias[k] : 0.f);
  }
}

const float* vector_of(const std::optional<at::Tensor>& t, int64_t n, const char* name, at::Tensor& held) {
  if (!t) {
    return nullptr;
  }
  TORCH_CHECK(t->numel() == n, "add_layer_norm: ", name, " must be a vector of the normalised dim's size ", n,
              ", got ", t->sizes());
  held = t->contiguous();
  return held.const_data_ptr<float>();
}

bool float32(const std::optional<at::Tensor>& t) {
  return !t || t->scalar_type() == at::kFloat;
}

// (normalised value, sum); the sum is written into the normalised value's memory
// first when it is not kept (`keep_sum` false: the second result is empty).
std::vector<at::Tensor> run(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, bool keep_sum) {
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_layer_norm: x and residual must have one shape, got ",
              x.sizes(), " and ", residual.sizes());
  TORCH_CHECK(x.dim() > 0, "add_layer_norm: x must have a dim to normalise");
  if (x.scalar_type() != at::kFloat || residual.scalar_type() != at::kFloat || !float32(weight) || !float32(bias)) {
    const at::Tensor summed = (x + residual).contiguous();
    const at::Tensor normed = at::layer_norm(summed, {x.size(-1)}, weight, bias, eps).contiguous();
    return {normed, keep_sum ? summed : at::empty({0}, x.options())};
  }
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor held_weight, held_bias;
  const float* w = vector_of(weight, n, "weight", held_weight);
  const float* b = vector_of(bias, n, "bias", held_bias);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = keep_sum ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* rp = rc.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = keep_sum ? sum.data_ptr<float>() : op;
  // Rows of a few hundred floats are too little work for a thread each.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      row(xp + i * n, rp + i * n, w, b, static_cast<float>(eps), n, sp + i * n, op + i * n);
    }
  });
  return {out, sum};
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, double eps) {
  auto results = run(x, residual, weight, bias, eps, true);
  return {results[0], results[1]};
}

at::Tensor skip_layer_norm(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps) {
  return run(x, residual, weight, bias, eps, false)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(graphopt, CPU, m) {
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("skip_layer_norm", &skip_layer_norm);
}
