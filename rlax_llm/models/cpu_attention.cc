// Decode attention on XLA:CPU: one query per slot over its KV-cache blocks, as an XLA FFI
// custom call. Built and registered by rlax_llm/models/cpu_attention.py, which documents it;
// the reference it must agree with is the decoder's XLA attention (tests/models).
//
// Why: XLA:CPU runs a decode step's attention products (per slot and kv head, a
// [groups, head_dim] x [head_dim, positions] product and its value product) on one thread,
// reading the cache at about 16 GB/s. This kernel reads each (slot, kv head) cache stream
// once, in memory order, on all of XLA's intra-op threads, and only the positions a slot
// holds (rounded up to 16), not whole attend buckets.
//
// Operands (float32 unless noted; blocks in the decoder's KVCache layouts):
//   q       [B, KV, G, D]     the step's queries, grouped by kv head;
//   keys    nblk x [B, KV, D, L]  (KEY_BLOCK_AXES: positions minor);
//   values  nblk x [B, KV, L, D]  (VALUE_BLOCK_AXES);
//   lengths int32 [B]         slot b attends to positions [0, lengths[b]), clamped to
//                              [1, nblk * L].
// Result:   [B, KV, G, D]     softmax(q k / sqrt(D)) v over those positions.
// Supported: D in {64, 128}, 1 <= G <= 8, L a multiple of 16 (the Python side checks).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // floats per vector (GCC vector extension; any ISA)
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for the softmax's x <= 0: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an
// exact n ln2), Cephes' degree-6 polynomial for exp(r), times 2^n through the exponent bits.
// About 1 ulp; inputs below -87.3 give exp(-87.3) ~ 1e-38 (the caller zeroes masked ones).
inline vf vexp(vf x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  vf n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n < 0 ? -0.5f : 0.5f), vi), vf);
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Problem {
  const float* q;
  std::vector<const float*> keys, values;  // one pointer per block
  const int32_t* lengths;
  float* out;
  int kv_heads, block, tasks;  // tasks = B * KV, one per (slot, kv head)
};

// One (slot, kv head): scores [G, n], softmax, then the value product.
template <int G, int D>
void Task(const Problem& p, int i, std::vector<float>& scratch) {
  const int capacity = static_cast<int>(p.keys.size()) * p.block;
  const int n = std::clamp(p.lengths[i / p.kv_heads], 1, capacity);
  const int padded = (n + kLanes - 1) / kLanes * kLanes;  // <= capacity: L % 16 == 0
  scratch.resize(static_cast<size_t>(G) * padded);
  float* s = scratch.data();  // row g at s + g * padded
  const float* q = p.q + static_cast<int64_t>(i) * G * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Scores, 64 positions at a time: the key block is [D, L] with positions minor, so each
  // d reads 256 contiguous bytes and the G query rows share every load.
  for (int start = 0; start < padded; start += p.block) {
    const float* k = p.keys[start / p.block] + static_cast<int64_t>(i) * D * p.block;
    const int m = std::min(p.block, padded - start);
    int j = 0;
    for (; j + 4 * kLanes <= m; j += 4 * kLanes) {
      vf acc[G][4] = {};
      for (int d = 0; d < D; ++d) {
        const float* row = k + d * p.block + j;
        const vf k0 = load(row), k1 = load(row + kLanes), k2 = load(row + 2 * kLanes),
                 k3 = load(row + 3 * kLanes);
        for (int g = 0; g < G; ++g) {
          const vf qg = splat(q[g * D + d]);
          acc[g][0] += qg * k0; acc[g][1] += qg * k1; acc[g][2] += qg * k2; acc[g][3] += qg * k3;
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) store(s + g * padded + start + j + c * kLanes, acc[g][c]);
    }
    for (; j < m; j += kLanes) {
      vf acc[G] = {};
      for (int d = 0; d < D; ++d) {
        const vf k0 = load(k + d * p.block + j);
        for (int g = 0; g < G; ++g) acc[g] += splat(q[g * D + d]) * k0;
      }
      for (int g = 0; g < G; ++g) store(s + g * padded + start + j, acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) {  // softmax over [0, n); the padding gets weight 0
    float* row = s + g * padded;
    float top = -INFINITY;
    for (int j = 0; j < n; ++j) top = std::max(top, row[j] * scale);
    vf sum = {};
    for (int j = 0; j < padded; j += kLanes) {
      const vf e = vexp(load(row + j) * scale - top);
      store(row + j, e);
      if (j + kLanes <= n) sum += e;
    }
    float total = 0.0f;
    for (int c = 0; c < kLanes; ++c) total += sum[c];
    for (int j = n / kLanes * kLanes; j < n; ++j) total += row[j];
    const float inv = 1.0f / total;
    for (int j = 0; j < n; ++j) row[j] *= inv;
  }
  vf acc[G][D / kLanes] = {};  // the value product, rows of D contiguous floats
  for (int start = 0; start < n; start += p.block) {
    const float* v = p.values[start / p.block] + static_cast<int64_t>(i) * p.block * D;
    const int m = std::min(p.block, n - start);
    for (int j = 0; j < m; ++j) {
      vf row[D / kLanes];
      for (int c = 0; c < D / kLanes; ++c) row[c] = load(v + j * D + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const vf w = splat(s[g * padded + start + j]);
        for (int c = 0; c < D / kLanes; ++c) acc[g][c] += w * row[c];
      }
    }
  }
  float* o = p.out + static_cast<int64_t>(i) * G * D;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / kLanes; ++c) store(o + g * D + c * kLanes, acc[g][c]);
}

using TaskFn = void (*)(const Problem&, int, std::vector<float>&);

template <int D>
TaskFn ForGroups(int groups) {
  switch (groups) {
    case 1: return Task<1, D>;
    case 2: return Task<2, D>;
    case 3: return Task<3, D>;
    case 4: return Task<4, D>;
    case 5: return Task<5, D>;
    case 6: return Task<6, D>;
    case 7: return Task<7, D>;
    case 8: return Task<8, D>;
  }
  return nullptr;
}

// Tasks are claimed from one counter by the calling thread and by helpers scheduled on
// XLA's intra-op pool. The caller waits only for tasks already claimed, which are running,
// so a helper the pool starts late (or never) cannot block it; the state is shared, so a
// late helper finds no task left and touches nothing freed.
struct Work {
  Problem problem;
  TaskFn fn;
  std::atomic<int> next{0}, done{0};
  void Run() {
    thread_local std::vector<float> scratch;
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < problem.tasks;) {
      fn(problem, i, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::RemainingArgs rest,
                               ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("q must be [B, KV, G, D]");
  const int64_t batch = qd[0], kv = qd[1], groups = qd[2], dim = qd[3];
  if (rest.size() < 3 || rest.size() % 2 == 0)
    return ffi::Error::InvalidArgument("operands: q, n key blocks, n value blocks, lengths");
  const int nblk = static_cast<int>((rest.size() - 1) / 2);
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  for (int b = 0; b < nblk; ++b) {
    auto k = rest.get<ffi::Buffer<ffi::F32>>(b);
    auto v = rest.get<ffi::Buffer<ffi::F32>>(nblk + b);
    if (!k.has_value() || !v.has_value())
      return ffi::Error::InvalidArgument("cache blocks must be float32");
    const auto kd = k->dimensions(), vd = v->dimensions();
    const int64_t block = kd.size() == 4 ? kd[3] : -1;
    if (kd.size() != 4 || vd.size() != 4 || kd[0] != batch || kd[1] != kv || kd[2] != dim ||
        vd[0] != batch || vd[1] != kv || vd[2] != block || vd[3] != dim ||
        (b > 0 && block != p.block) || block % kLanes != 0)
      return ffi::Error::InvalidArgument(
          "cache blocks must be keys [B, KV, D, L] and values [B, KV, L, D] with one L, a "
          "multiple of 16");
    p.block = static_cast<int>(block);
    p.keys.push_back(k->typed_data());
    p.values.push_back(v->typed_data());
  }
  auto lengths = rest.get<ffi::Buffer<ffi::S32>>(rest.size() - 1);
  if (!lengths.has_value() || lengths->dimensions().size() != 1 ||
      lengths->dimensions()[0] != batch)
    return ffi::Error::InvalidArgument("lengths must be int32 [B]");
  work->fn = dim == 64 ? ForGroups<64>(static_cast<int>(groups))
           : dim == 128 ? ForGroups<128>(static_cast<int>(groups)) : nullptr;
  if (work->fn == nullptr)
    return ffi::Error::InvalidArgument("supported: head_dim 64 or 128, 1-8 queries per kv head");
  p.q = q.typed_data();
  p.lengths = lengths->typed_data();
  p.out = out->typed_data();
  p.kv_heads = static_cast<int>(kv);
  p.tasks = static_cast<int>(batch * kv);
  const int helpers = std::min<int64_t>(pool.num_threads(), p.tasks) - 1;
  for (int h = 0; h < helpers; ++h) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < p.tasks) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlaxLlmDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());
