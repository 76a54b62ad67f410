// vitkit::int8_block: one encoder block of the int8 model (eq. 2 and 3 of the paper) as one parallel region.
//
//   x' = x + proj(MSA(LN1(x)))          (2)
//   y  = x' + fc2(GELU(fc1(LN2(x'))))   (3)
//
// ATen runs every operator of a block as a parallel region of its own (LayerNorm, each int8 product, the
// attention's casts, products and softmax, GELU, the adds): about fifteen per block, and at each one the
// threads wait for each other. Here each of the n intra-op threads goes through its own share of the rows
// (all tokens of all images, cut in n) for everything but the attention, and through its own share of the
// (image, head) pairs in the attention: two meeting points per block. Inside the region every ATen operator
// runs on its calling thread alone (ATen and oneDNN see that they are inside a parallel region).
//
// `shares`: how many shares the rows and the pairs are cut into (the caller passes the number of intra-op
// threads). The int8 products quantise their input per call (fbgemm's dynamic quantisation: one scale per
// tensor); here the tensor is a share of the rows, so the activation scales are per share and the result
// depends, slightly, on `shares`. With fewer threads than shares (one intra-op thread, or a region inside
// another), the first thread works through every share in turn: the same shares, the same result.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <omp.h>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// A reusable barrier for a fixed number of threads that spin (with pause) rather than sleep: the waits here
// are short, and a sleeping thread costs a wake-up at every meeting point.
class SpinBarrier {
 public:
  explicit SpinBarrier(int parties) : parties_(parties) {}

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == parties_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) {
      __builtin_ia32_pause();
    }
  }

 private:
  const int parties_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

// [begin, end) of share `part` of `count` items cut into `parts`.
inline std::pair<int64_t, int64_t> share(int64_t count, int part, int parts) {
  return {count * part / parts, count * (part + 1) / parts};
}

at::Tensor int8_block(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      const Packed& qkv, const Packed& proj, const Packed& fc1, const Packed& fc2,
                      bool reduce_range, int64_t heads, double scale, bool bf16_attention,
                      c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "int8_block: expected fp32 tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(heads > 0 && D % heads == 0, "int8_block: width ", D, " is not divisible by ", heads, " heads");
  TORCH_CHECK(shares >= 1, "int8_block: shares=", shares, " must be at least 1");
  const int64_t Dh = D / heads, rows = B * T, pairs = B * heads;

  const at::Tensor tokens = x.view({rows, D});
  at::Tensor out = at::empty_like(x);
  const at::Tensor out_rows = out.view({rows, D});
  // q, k, v per (image, head), in the attention's dtype; the heads' outputs merged back, fp32.
  const at::Tensor qkv_heads =
      at::empty({3, B, heads, T, Dh}, x.options().dtype(bf16_attention ? at::kBFloat16 : at::kFloat));
  const at::Tensor q_all = qkv_heads[0].view({pairs, T, Dh});
  const at::Tensor k_all = qkv_heads[1].view({pairs, T, Dh});
  const at::Tensor v_all = qkv_heads[2].view({pairs, T, Dh});
  const at::Tensor merged = at::empty({B, T, heads, Dh}, x.options());
  const at::Tensor merged_rows = merged.view({rows, D});

  // Step 1 (rows): LN1, the q;k;v product, laid out per head.
  auto project = [&](int part, int parts) {
    const auto [r0, r1] = share(rows, part, parts);
    if (r1 <= r0) return;
    const at::Tensor h = at::layer_norm(tokens.slice(0, r0, r1), {D}, ln1_weight, ln1_bias, ln1_eps);
    const at::Tensor q = qkv->apply_dynamic(h, reduce_range).view({r1 - r0, 3, heads, Dh});
    for (int64_t r = r0; r < r1;) {  // the share may span several images: one copy per image
      const int64_t b = r / T, t = r % T, n = std::min(r1 - r, T - t);
      qkv_heads.select(1, b).slice(2, t, t + n).copy_(q.slice(0, r - r0, r - r0 + n).permute({1, 2, 0, 3}));
      r += n;
    }
  };
  // Step 2 ((image, head) pairs): softmax(q k^T scale) v, the scale riding on the first product.
  auto attend = [&](int part, int parts) {
    const auto [p0, p1] = share(pairs, part, parts);
    if (p1 <= p0) return;
    const at::Tensor q = q_all.slice(0, p0, p1), k = k_all.slice(0, p0, p1), v = v_all.slice(0, p0, p1);
    const at::Tensor scores = at::baddbmm(at::empty({p1 - p0, T, T}, q.options()), q, k.transpose(1, 2), 0, scale);
    const at::Tensor y = at::bmm(scores.softmax(-1), v);  // (pairs, T, Dh)
    for (int64_t p = p0; p < p1; ++p) {
      merged.select(0, p / heads).select(1, p % heads).copy_(y[p - p0]);
    }
  };
  // Step 3 (rows): the output projection and residual (2), then the MLP and residual (3).
  auto mix = [&](int part, int parts) {
    const auto [r0, r1] = share(rows, part, parts);
    if (r1 <= r0) return;
    const at::Tensor x2 = proj->apply_dynamic(merged_rows.slice(0, r0, r1), reduce_range).add_(tokens.slice(0, r0, r1));
    const at::Tensor h = at::layer_norm(x2, {D}, ln2_weight, ln2_bias, ln2_eps);
    at::Tensor hidden = fc1->apply_dynamic(h, reduce_range);
    at::gelu_(hidden, gelu_approximate);
    out_rows.slice(0, r0, r1).copy_(fc2->apply_dynamic(hidden, reduce_range).add_(x2));
  };

  const int parts = static_cast<int>(shares);
  SpinBarrier barrier(parts);
  const at::ThreadLocalState state;  // inference mode and the like, for the region's threads
#pragma omp parallel num_threads(std::min(parts, std::max(1, at::get_num_threads())))
  {
    const at::ThreadLocalStateGuard guard(state);
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    if (team == parts) {
      project(me, parts);
      barrier.wait();
      attend(me, parts);
      barrier.wait();
      mix(me, parts);
    } else if (me == 0) {  // fewer threads than shares: the same shares, one after another
      for (int part = 0; part < parts; ++part) project(part, parts);
      for (int part = 0; part < parts; ++part) attend(part, parts);
      for (int part = 0; part < parts; ++part) mix(part, parts);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vitkit, m) {
  m.def(
      "int8_block(Tensor x, Tensor ln1_weight, Tensor ln1_bias, float ln1_eps, Tensor ln2_weight, "
      "Tensor ln2_bias, float ln2_eps, __torch__.torch.classes.quantized.LinearPackedParamsBase qkv, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase proj, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase fc1, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase fc2, bool reduce_range, int heads, "
      "float scale, bool bf16_attention, str gelu_approximate, int shares) -> Tensor");
  m.impl("int8_block", c10::DispatchKey::CPU, TORCH_FN(int8_block));
}
