// An encoder block (eq. 2 and 3 of the paper) as one parallel region: the mechanics of int8_block.cpp's operator
// apart from its layers.
//
//   x' = x + proj(MSA(LN1(x)))          (2)
//   y  = x' + fc2(GELU(fc1(LN2(x'))))   (3)
//
// ATen runs every operator of a block as a parallel region of its own (each LayerNorm, product, copy,
// softmax, activation and add), and at each one the threads wait for each other. Here each of `shares`
// threads goes through its own share of the rows (all tokens of all images, cut in `shares`) for everything
// but the attention, and through its own share of the (image, head) pairs in the attention: two meeting
// points per block. Inside the region every ATen operator runs on its calling thread alone (ATen and oneDNN
// see that they are inside a parallel region). With fewer threads than shares (one intra-op thread, or a
// region inside another), the first thread works through every share in turn: the same shares, the same
// result.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <omp.h>
#include <utility>

namespace vitkit {

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
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield");
#endif
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

// fn(b0, b1) for rows [r0, r1) in blocks of about `target` rows, each a whole number of `tile`-row tiles but
// the last, the tiles dealt out evenly: no last block of a row or two, which would stream every weight of a
// product for nothing (for 541 rows in blocks of ~54, ten of 54 and one of a single row).
template <typename Fn>
inline void row_blocks(int64_t r0, int64_t r1, int64_t tile, int64_t target, Fn&& fn) {
  const int64_t tiles = (r1 - r0 + tile - 1) / tile;
  const int64_t blocks = std::max<int64_t>(1, (r1 - r0 + target / 2) / target);
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t b0 = r0 + tile * (tiles * i / blocks);
    const int64_t b1 = std::min(r1, r0 + tile * (tiles * (i + 1) / blocks));
    if (b1 > b0) fn(b0, b1);
  }
}

using Step = std::function<void(int64_t begin, int64_t end)>;

// The three steps of a block, each over its share: `project` and `mix` over rows [0, rows), `attend` over
// (image, head) pairs [0, pairs); a meeting point after each of the first two.
inline void run_block(int64_t shares, int64_t rows, int64_t pairs, const Step& project, const Step& attend,
                      const Step& mix) {
  TORCH_CHECK(shares >= 1, "shares=", shares, " must be at least 1");
  const int parts = static_cast<int>(shares);
  auto step = [&](const Step& fn, int64_t count, int part) {
    const auto [begin, end] = share(count, part, parts);
    if (end > begin) fn(begin, end);
  };
  SpinBarrier barrier(parts);
  const at::ThreadLocalState state;  // inference mode and the like, for the region's threads
#pragma omp parallel num_threads(std::min(parts, std::max(1, at::get_num_threads())))
  {
    const at::ThreadLocalStateGuard guard(state);
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    if (team == parts) {
      step(project, rows, me);
      barrier.wait();
      step(attend, pairs, me);
      barrier.wait();
      step(mix, rows, me);
    } else if (me == 0) {
      for (int part = 0; part < parts; ++part) step(project, rows, part);
      for (int part = 0; part < parts; ++part) step(attend, pairs, part);
      for (int part = 0; part < parts; ++part) step(mix, rows, part);
    }
  }
}

// softmax(q k^T scale) v for the (image, head) pairs [p0, p1) (pair p: image p / H, head p % H) of the fused
// q;k;v projection's output `qkv` (B, T, 3, H, Dh), read in place by SDPA's fused kernel (run by this thread
// alone: the region is already parallel), written into `merged` (B, T, H, Dh) fp32. One call per image, on its
// heads in the range: an image's q, k and v stay in the cache (ViT-S/16, 8 images of 6 heads: 1.2-1.3x faster
// than one call on all eight). The kernel computes every pair on its own, so the cut leaves the numbers as they
// are.
inline void attend_pairs(const at::Tensor& qkv, int64_t p0, int64_t p1, double scale, const at::Tensor& merged) {
  const int64_t H = qkv.size(3);
  for (int64_t p = p0; p < p1;) {
    const int64_t b = p / H, h = p % H, nh = std::min(p1 - p, H - h);
    const at::Tensor part = qkv.select(0, b).slice(2, h, h + nh).unsqueeze(0);  // (1, T, 3, nh, Dh)
    const at::Tensor y = at::scaled_dot_product_attention(  // (1, nh, T, Dh)
        part.select(2, 0).transpose(1, 2), part.select(2, 1).transpose(1, 2), part.select(2, 2).transpose(1, 2),
        {}, 0.0, false, scale);
    merged.select(0, b).slice(1, h, h + nh).copy_(y.select(0, 0).transpose(0, 1));
    p += nh;
  }
}

}  // namespace vitkit
