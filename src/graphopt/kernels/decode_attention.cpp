// graphopt::decode_attention's CPU kernel. Built by decode_attention.py with torch's
// JIT C++ extension loader, for the machine's vector ISA (AVX2 or AVX-512 where torch
// reports it); loading the library registers this kernel for the CPU dispatch key,
// so a call through the dispatcher (and a host graph's replay) never enters Python.
//
// For each sequence row i, kv head g and query j it reads the keys and values of cache
// row slots[i] (row i without slots) where they lie, 0 .. positions[i, j] (every key
// without positions) and of those only the ones allowed[i, j, s] lets through (when
// given), once for all n_rep query heads that share g: one pass over K computing
// scores, a max-subtracted softmax, one pass over V accumulating the output. Nothing is
// gathered or repeated, and no key past the sequence's length or masked out is read.
// A query with no key to read averages every key of its row with equal weights, as
// eager attention under a `finfo.min` mask does (every score is then finfo.min).

// ATen and the op registry only: torch/extension.h adds the whole C++ frontend and
// pybind, three times the compile time of this file.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

using at::vec::Vectorized;

template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using Vec = Vectorized<acc_t>;
  Vec sum(acc_t(0));
  int64_t k = 0;
  for (; k + Vec::size() <= n; k += Vec::size()) {
    sum = at::vec::fmadd(Vec::loadu(a + k), Vec::loadu(b + k), sum);
  }
  acc_t total = at::vec::vec_reduce_all<acc_t>([](Vec& x, Vec& y) { return x + y; }, sum);
  for (; k < n; ++k) {
    total += a[k] * b[k];
  }
  return total;
}

// out += p * x
template <typename acc_t>
void axpy(acc_t* out, acc_t p, const acc_t* x, int64_t n) {
  using Vec = Vectorized<acc_t>;
  const Vec pv(p);
  int64_t k = 0;
  for (; k + Vec::size() <= n; k += Vec::size()) {
    at::vec::fmadd(pv, Vec::loadu(x + k), Vec::loadu(out + k)).store(out + k);
  }
  for (; k < n; ++k) {
    out[k] += p * x[k];
  }
}

// A row of `n` elements `stride` apart, in acc_t: the row itself when it already is
// one (float, contiguous), else converted into `buffer`.
template <typename scalar_t, typename acc_t>
const acc_t* row(const scalar_t* src, int64_t stride, int64_t n, acc_t* buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (stride == 1) {
      return src;
    }
  }
  if (stride == 1) {
    at::vec::convert(src, buffer, n);
  } else {
    for (int64_t k = 0; k < n; ++k) {
      buffer[k] = static_cast<acc_t>(src[k * stride]);
    }
  }
  return buffer;
}

// The keys query (i, j) reads: 0 .. length - 1, less those `allowed` masks out.
struct Keys {
  const int64_t* pos;  // [b, t] with strides, or null: every key
  int64_t pos_stride[2];
  const bool* allowed;  // [b, t, s] with strides, or null: no key masked
  int64_t allowed_stride[3];

  int64_t length(int64_t i, int64_t j, int64_t capacity) const {
    // Keys 0 .. position: none before the first, all of the cache past its end, as the
    // mask `key <= position` allows.
    return pos ? std::clamp<int64_t>(pos[i * pos_stride[0] + j * pos_stride[1]] + 1, 0, capacity) : capacity;
  }

  // Fills `live` with the keys read, in order; returns how many.
  int64_t live(int64_t i, int64_t j, int64_t capacity, int64_t* out) const {
    const int64_t n = length(i, j, capacity);
    if (!allowed) {
      std::iota(out, out + n, int64_t(0));
      return n;
    }
    const bool* row = allowed + i * allowed_stride[0] + j * allowed_stride[1];
    int64_t count = 0;
    for (int64_t s = 0; s < n; ++s) {
      if (row[s * allowed_stride[2]]) {
        out[count++] = s;
      }
    }
    return count;
  }
};

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, const int64_t* rows,
            const Keys& keys, double scale, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = key.size(1), capacity = key.size(2), n_rep = heads / kv_heads;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = key.const_data_ptr<scalar_t>();
  const scalar_t* v_data = value.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const auto qs = q.strides(), ks = key.strides(), vs = value.strides();

  // One work item per (row, kv head, query): its n_rep query heads read each key once.
  at::parallel_for(0, batch * kv_heads * queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> query(n_rep * dim), acc(n_rep * dim), scores(n_rep * capacity), buffer(dim);
    std::vector<int64_t> live(capacity);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / (kv_heads * queries), g = item / queries % kv_heads, j = item % queries;
      int64_t length = keys.live(i, j, capacity, live.data());
      const bool uniform = length == 0;
      if (uniform) {
        std::iota(live.begin(), live.end(), int64_t(0));
        length = capacity;
      }
      const scalar_t* k_row = k_data + rows[i] * ks[0] + g * ks[1];
      const scalar_t* v_row = v_data + rows[i] * vs[0] + g * vs[1];
      for (int64_t r = 0; r < n_rep; ++r) {
        const scalar_t* src = q_data + i * qs[0] + (g * n_rep + r) * qs[1] + j * qs[2];
        const acc_t* converted = row<scalar_t, acc_t>(src, qs[3], dim, buffer.data());
        std::copy(converted, converted + dim, query.begin() + r * dim);
      }
      for (int64_t s = 0; s < length; ++s) {
        const acc_t* k = row<scalar_t, acc_t>(k_row + live[s] * ks[2], ks[3], dim, buffer.data());
        for (int64_t r = 0; r < n_rep; ++r) {
          scores[r * capacity + s] = uniform ? acc_t(0) : dot(query.data() + r * dim, k, dim) * static_cast<acc_t>(scale);
        }
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::vector<acc_t> total(n_rep, acc_t(0));
      for (int64_t r = 0; r < n_rep; ++r) {
        acc_t* p = scores.data() + r * capacity;
        const acc_t max = at::vec::reduce_all<acc_t>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, p, length);
        at::vec::map([max](Vec x) { return (x - Vec(max)).exp(); }, p, p, length);
        total[r] = at::vec::reduce_all<acc_t>([](Vec& x, Vec& y) { return x + y; }, p, length);
      }
      for (int64_t s = 0; s < length; ++s) {
        const acc_t* v = row<scalar_t, acc_t>(v_row + live[s] * vs[2], vs[3], dim, buffer.data());
        for (int64_t r = 0; r < n_rep; ++r) {
          axpy(acc.data() + r * dim, scores[r * capacity + s], v, dim);
        }
      }
      for (int64_t r = 0; r < n_rep; ++r) {
        const acc_t norm = acc_t(1) / total[r];
        scalar_t* dst = out_data + ((i * heads + g * n_rep + r) * queries + j) * dim;
        for (int64_t k = 0; k < dim; ++k) {
          dst[k] = static_cast<scalar_t>(acc[r * dim + k] * norm);
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& slots, const std::optional<at::Tensor>& positions,
                            double scale, const std::optional<at::Tensor>& allowed) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "decode_attention: query [b, h, t, d], key and value [n, kv_heads, s, d]");
  const int64_t batch = query.size(0), heads = query.size(1), queries = query.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(3) == query.size(3) && heads % key.size(1) == 0,
              "decode_attention: key and value must be [n, kv_heads, s, d] with heads a multiple of kv_heads");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "decode_attention: query, key and value must have one dtype");
  // Row i of the cache for sequence i: slots[i], wrapped like an index, or i itself.
  const int64_t n = key.size(0);
  std::vector<int64_t> rows(batch);
  if (slots) {
    TORCH_CHECK(slots->dim() == 1 && slots->size(0) == batch, "decode_attention: slots must be [b]");
    const at::Tensor given = slots->to(at::kLong).contiguous();
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t slot = given.const_data_ptr<int64_t>()[i];
      TORCH_CHECK(slot >= -n && slot < n, "decode_attention: slot ", slot, " is out of range for ", n, " cache rows");
      rows[i] = slot < 0 ? slot + n : slot;
    }
  } else {
    TORCH_CHECK(n == batch, "decode_attention: without slots, key and value have one row per query row");
    std::iota(rows.begin(), rows.end(), int64_t(0));
  }
  Keys keys{};
  at::Tensor pos, mask;  // held while the kernel reads them
  if (positions) {
    pos = positions->to(at::kLong).expand({batch, queries});
    keys.pos = pos.const_data_ptr<int64_t>();
    keys.pos_stride[0] = pos.stride(0);
    keys.pos_stride[1] = pos.stride(1);
  }
  if (allowed) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool, "decode_attention: allowed must be a bool tensor");
    mask = allowed->expand({batch, queries, key.size(2)});
    keys.allowed = mask.const_data_ptr<bool>();
    for (int d = 0; d < 3; ++d) {
      keys.allowed_stride[d] = mask.stride(d);
    }
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attention", [&] {
    attend<scalar_t>(query, key, value, rows.data(), keys, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(graphopt, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
