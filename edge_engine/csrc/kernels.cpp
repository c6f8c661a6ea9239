// edge_engine's compiled kernels as torch sees them: the quantised linears, the fused decode
// step (Q4Decoder) and the Python module.  The arithmetic is in ops_impl.h (one copy per
// instruction set, picked at load time: ops.h); this file checks tensors and splits work
// over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

using edge::kGroup;
using edge::kTile;

// ---- weights ----------------------------------------------------------------------------
edge::Q4 q4_of(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.size(2) == 256,
              "packed must be [tiles, K/32, 256] uint8");
  const int64_t T = packed.size(0), G = packed.size(1);
  TORCH_CHECK(N > (T - 1) * kTile && N <= T * kTile, "N does not match the tiles");
  for (const auto* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->dim() == 3, "scales/mins must be fp16");
    TORCH_CHECK(t->size(0) == T && t->size(1) == G && t->size(2) == kTile, "scales/mins must be [tiles, K/32, 16]");
  }
  return {packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
          reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), N, G * kGroup};
}

edge::Q8 q8_of(const torch::Tensor& q, const torch::Tensor& scales, int64_t N) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kByte && q.is_contiguous() && q.size(2) == 512,
              "q must be [tiles, K/32, 512] uint8");
  const int64_t T = q.size(0), G = q.size(1);
  TORCH_CHECK(N > (T - 1) * kTile && N <= T * kTile, "N does not match the tiles");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 3, "scales must be fp16");
  TORCH_CHECK(scales.size(0) == T && scales.size(1) == G && scales.size(2) == kTile, "scales must be [tiles, K/32, 16]");
  return {q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), N, G * kGroup};
}

// ---- 8-bit activation rows ----------------------------------------------------------------
struct Rows8Buffer {
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
  edge::Rows8 view(int64_t M, int64_t K) {
    const int64_t G = K / kGroup;
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    if (static_cast<int64_t>(d.size()) < M * G) d.resize(M * G), xsum.resize(M * G), qsum.resize(M * G);
    return {q.data(), d.data(), xsum.data(), qsum.data(), K};
  }
};

edge::Rows8 quantize(const float* x, int64_t M, int64_t K, Rows8Buffer& buf) {
  const edge::Rows8 r = buf.view(M, K);
  const auto& o = edge::ops();
  if (M * K < (1 << 16)) {
    o.quantize_rows(x, K, 0, M, r);
  } else {
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) { o.quantize_rows(x, K, m0, m1, r); });
  }
  return r;
}

// ---- y[M, N] = x[M, K] W^T: tiles of W over the threads, every row of x per tile ----------
int64_t tile_grain(int64_t T, int64_t M) {
  // enough work per task to pay for a thread's start; the rows' x stays hot per task
  return std::max<int64_t>(1, std::min<int64_t>(T, 64 / std::max<int64_t>(1, M)));
}

void q4_matmul(const float* x, int64_t M, const edge::Q4& w, float* y, bool a8, Rows8Buffer& buf) {
  const auto& o = edge::ops();
  const int64_t T = w.tiles();
  if (a8) {
    const edge::Rows8 r = quantize(x, M, w.K, buf);
    at::parallel_for(0, T, tile_grain(T, M), [&](int64_t t0, int64_t t1) { o.q4_a8(r, M, w, t0, t1, y, w.N); });
  } else {
    at::parallel_for(0, T, tile_grain(T, M), [&](int64_t t0, int64_t t1) { o.q4_f32(x, w.K, M, w, t0, t1, y, w.N); });
  }
}

void q8_matmul(const float* x, int64_t M, const edge::Q8& w, float* y, bool a8, Rows8Buffer& buf) {
  const auto& o = edge::ops();
  const int64_t T = w.tiles();
  if (a8) {
    const edge::Rows8 r = quantize(x, M, w.K, buf);
    at::parallel_for(0, T, tile_grain(T, M), [&](int64_t t0, int64_t t1) { o.q8_a8(r, M, w, t0, t1, y, w.N); });
  } else {
    at::parallel_for(0, T, tile_grain(T, M), [&](int64_t t0, int64_t t1) { o.q8_f32(x, w.K, M, w, t0, t1, y, w.N); });
  }
}

torch::Tensor check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  return x.contiguous();
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t n, bool a8) {
  const edge::Q4 w = q4_of(packed, scales, mins, n);
  x = check_x(x, w.K);
  auto y = torch::empty({x.size(0), w.N}, x.options());
  Rows8Buffer buf;
  if (x.size(0) > 0) q4_matmul(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>(), a8, buf);
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t n, bool a8) {
  const edge::Q8 w = q8_of(q, scales, n);
  x = check_x(x, w.K);
  auto y = torch::empty({x.size(0), w.N}, x.options());
  Rows8Buffer buf;
  if (x.size(0) > 0) q8_matmul(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>(), a8, buf);
  return y;
}

// HF rotate_half RoPE on one head: x * cos + roll(x, D/2) * signed_sin (the model's table)
void rope(float* x, const float* cos, const float* ssin, int64_t D) {
  float t[512];
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) t[i] = x[i] * cos[i] + x[(i + h) % D] * ssin[i];
  std::memcpy(x, t, D * sizeof(float));
}

// One layer's weights, in the order Q4Decoder takes them (14 tensors).
struct Layer {
  const float* attn_norm;
  edge::Q4 wqkv, wo;
  const float* ffn_norm;
  edge::Q4 w13, w2;
};

// A step's rows (decode tokens, or the tokens of prefill chunks) through all layers in one
// call: the same arithmetic as model.py's TransformerBlock (float32 residual stream, norms,
// attention and KV cache; the Q4 weights times float32 or 8-bit activations), without ~100
// Python-dispatched ops per layer.  The KV cache is model.py's paged layout; each row has
// its own blocks and context length (a prefill chunk's rows share their blocks: row i's
// K/V are written before any row attends, and row i sees the first lens[i] tokens).
class Q4Decoder {
 public:
  Q4Decoder(std::vector<torch::Tensor> params, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool a8)
      : params_(std::move(params)), H_(num_heads), KH_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)), a8_(a8) {
    TORCH_CHECK(params_.size() % 14 == 0, "14 tensors per layer");
    TORCH_CHECK(D_ <= 512 && H_ % KH_ == 0, "bad attention shape");
    for (size_t i = 0; i < params_.size(); i += 14) {
      const auto& p = params_;
      for (size_t j : {i, i + 7})
        TORCH_CHECK(p[j].scalar_type() == torch::kFloat && p[j].is_contiguous(), "norm weights must be float32");
      auto q4 = [&](size_t j) { return q4_of(p[j], p[j + 1], p[j + 2], p[j].size(0) * kTile); };
      layers_.push_back({p[i].data_ptr<float>(), q4(i + 1), q4(i + 4), p[i + 7].data_ptr<float>(), q4(i + 8), q4(i + 11)});
    }
    hidden_ = layers_.at(0).wo.N;
    ffn_ = layers_.at(0).w2.K;
    TORCH_CHECK(layers_[0].wqkv.N == (H_ + 2 * KH_) * D_ && layers_[0].w13.N == 2 * ffn_, "bad layer shapes");
  }

  // x: [B, hidden] embeddings; rope: [B, 2, D] (cos, signed sin) at each row's position;
  // k_caches, v_caches: per layer [num_blocks, block_size, KH, D]; slots: [B] (where this
  // token's K/V go); tables: [B, W] (each row's blocks); lens: [B] (context length with
  // this token).  Returns the last layer's output [B, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor rope_rows, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens) {
    const int64_t B = x.size(0), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(B >= 1 && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat, "x must be [B, hidden] float32");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L, "one cache per layer");
    for (const auto* cs : {&k_caches, &v_caches})
      for (const auto& c : *cs)
        TORCH_CHECK(c.sizes() == k_caches[0].sizes() && c.scalar_type() == torch::kFloat && c.is_contiguous() && c.dim() == 4 &&
                        c.size(2) == KH_ && c.size(3) == D_,
                    "caches must be [num_blocks, block_size, KH, D] float32");
    for (const auto* t : {&slots, &tables, &lens})
      TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(), "int64 metadata");
    TORCH_CHECK(tables.size(0) == B && slots.size(0) == B && lens.size(0) == B, "one entry per row");
    rope_rows = rope_rows.contiguous();
    auto out = x.contiguous().clone();
    float* h = out.data_ptr<float>();
    const int64_t qkv_n = (H_ + 2 * KH_) * D_, num_blocks = k_caches[0].size(0), bs = k_caches[0].size(1), W = tables.size(1);
    const int64_t slot_stride = KH_ * D_;
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(len[b] >= 1 && len[b] <= W * bs && slot[b] >= 0 && slot[b] < num_blocks * bs, "row metadata out of range");
      max_len = std::max(max_len, len[b]);
    }
    const auto& o = edge::ops();
    std::vector<float> normed(B * std::max(hidden_, ffn_)), qkv(B * qkv_n), att(B * H_ * D_), gu(B * 2 * ffn_),
        act(B * ffn_), tmp(B * hidden_);
    const float* rp = rope_rows.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(D_));
    const int64_t group = H_ / KH_;  // query heads per KV head
    const int64_t threads = at::get_num_threads();
    std::vector<float> scores(std::max<int64_t>(1, std::min<int64_t>(B * H_, threads)) * max_len);
    Rows8Buffer buf;
    auto norm_rows = [&](const float* weight) {
      at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) o.rms_norm(h + b * hidden_, weight, normed.data() + b * hidden_, hidden_, eps_);
      });
    };
    for (int64_t l = 0; l < L; ++l) {
      const Layer& w = layers_[l];
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      norm_rows(w.attn_norm);
      q4_matmul(normed.data(), B, w.wqkv, qkv.data(), a8_, buf);
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * qkv_n;
        const float* cs = rp + b * 2 * D_;
        for (int64_t head = 0; head < H_ + KH_; ++head) rope(r + head * D_, cs, cs + D_, D_);
        std::memcpy(kc + slot[b] * slot_stride, r + H_ * D_, slot_stride * sizeof(float));
        std::memcpy(vc + slot[b] * slot_stride, r + (H_ + KH_) * D_, slot_stride * sizeof(float));
      }
      // attention: one task per (row, query head), each over its row's paged context; a
      // thread's chunk of tasks shares one score buffer
      int64_t work = 0;
      for (int64_t b = 0; b < B; ++b) work += len[b];
      work *= H_ * D_;
      const int64_t tasks = B * H_;
      const int64_t grain = work < (1 << 15) ? tasks : std::max<int64_t>(1, tasks / (4 * threads));
      at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
        float* sc = scores.data() + (at::get_thread_num() % std::max<int64_t>(1, std::min<int64_t>(tasks, threads))) * max_len;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / H_, head = task % H_;
          const int64_t kv_offset = (head / group) * D_;
          const float* q = qkv.data() + b * qkv_n + head * D_;
          o.attend(q, kc, vc, table + b * W, bs, slot_stride, kv_offset, len[b], D_, scale, sc, att.data() + task * D_);
        }
      });
      q4_matmul(att.data(), B, w.wo, tmp.data(), a8_, buf);
      for (int64_t i = 0; i < B * hidden_; ++i) h[i] += tmp[i];
      norm_rows(w.ffn_norm);
      q4_matmul(normed.data(), B, w.w13, gu.data(), a8_, buf);
      at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {  // SiLU(gate) * up
          const float* gate = gu.data() + b * 2 * ffn_;
          const float* up = gate + ffn_;
          float* a = act.data() + b * ffn_;
          for (int64_t i = 0; i < ffn_; ++i) a[i] = -gate[i];
          o.exp_inplace(a, ffn_);
          for (int64_t i = 0; i < ffn_; ++i) a[i] = gate[i] / (1.f + a[i]) * up[i];
        }
      });
      q4_matmul(act.data(), B, w.w2, tmp.data(), a8_, buf);
      for (int64_t i = 0; i < B * hidden_; ++i) h[i] += tmp[i];
    }
    return out;
  }

 private:
  std::vector<torch::Tensor> params_;  // keeps the weights alive
  std::vector<Layer> layers_;
  int64_t H_, KH_, D_, hidden_ = 0, ffn_ = 0;
  float eps_;
  bool a8_;
};

pybind11::dict isa_info() {
  pybind11::dict d;
  d["isa"] = edge::ops().name;
  d["note"] = edge::ops_note();
  pybind11::list has;
  for (const char* name : {"avx512_vnni", "avxvnni", "avx2", "generic"})
    if (edge::cpu_has(name)) has.append(name);
  d["cpu"] = has;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the step thread lets go of the GIL while it computes, as torch's own ops do
  using pybind11::arg;
  m.def("q4_linear", &q4_linear, "Q4_1-grid weights (tiles) x float32 or 8-bit activations", arg("x"), arg("packed"),
        arg("scales"), arg("mins"), arg("n"), arg("a8"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_linear", &q8_linear, "Q8_0-grid weights (tiles) x float32 or 8-bit activations", arg("x"), arg("q"), arg("scales"),
        arg("n"), arg("a8"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isa_info", &isa_info, "the instruction set the kernels run on, and what this CPU has");
  pybind11::class_<Q4Decoder>(m, "Q4Decoder")
      .def(pybind11::init<std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, bool>())
      .def("forward", &Q4Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
