// Exact tail-biting Viterbi for EXL3 trellis tiles: the node-based search of viterbi.py, fused.
//
// The torch search makes one pass over memory per elementwise op and position (squared error, plus the
// entry cost, node minimum); here one loop computes, per vector of output nodes, the minimum over their
// 2^D(p+1) candidate states and records which one won, with everything in cache and in SIMD registers.
// Arithmetic is the torch path's, op for op: ((v - w) * (v - w)) + entry in float32 with no FMA
// contraction (built with -ffp-contract=off), and ties go to the lowest candidate as torch.argmin does,
// so both paths return the same states bit for bit.
//
// A plain C entry point (called through ctypes: no torch headers, so it builds in seconds).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPositions = 256;
constexpr int kStateBits = 16;
// One vector is one SIMD register of the build's CPU: a wider GCC vector than the hardware has is split
// into halves that spill through the stack at every op (on AVX2, 16 lanes ran 7-16x slower than 8).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;  // SSE, NEON
#endif
constexpr int kPad = kLanes;  // entry costs are read a whole vector at a time, up to kLanes past the last node

// GCC vector extensions: kLanes float lanes, lowered to AVX-512, AVX2, SSE or NEON by -march=native.
typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));
// A decision is the winning top's DN bits; they are stored as DN bit planes of kLanes bits per vector of
// nodes (one Mask per plane), not a byte per node: at low rates the byte form wrote 8 MB per tile, more
// than the L2 holds, and the search spent two thirds of its time on that memory traffic.
typedef std::conditional_t<(kLanes > 8), uint16_t, uint8_t> Mask;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat broadcast(float x) { return __builtin_shuffle(vfloat{x}, vint{}); }

// Entry costs of kLanes consecutive candidate states whose first one leaves node *entry: entry[s >> D],
// each node repeated 2^D times (one node for the whole vector when 2^D >= kLanes).
template <int D>
inline vfloat entry_lanes(const float* entry) {
  if constexpr ((1 << D) >= kLanes) {
    return broadcast(*entry);
  } else {
    vint spread;
    for (int l = 0; l < kLanes; ++l) spread[l] = l >> D;
    return __builtin_shuffle(load(entry), spread);
  }
}

// Bit b of every lane of a, as a mask (lane l -> bit l): one movemask where the CPU has it (extracting
// lane by lane cost more than the memory the planes save).
inline Mask plane(vint a, int b) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)a, _mm512_set1_epi32(1 << b));
#elif defined(__AVX2__)
  return Mask(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32((__m256i)a, 31 - b))));
#elif defined(__SSE2__) && !defined(__AVX__)
  return Mask(_mm_movemask_ps(_mm_castsi128_ps(_mm_slli_epi32((__m128i)a, 31 - b))));
#else
  Mask m = 0;
  for (int l = 0; l < kLanes; ++l) m |= Mask((a[l] >> b) & 1) << l;
  return m;
#endif
}

// One position with D new bits, followed by one with DN: for every node n after it (the low 16 - DN bits
// of the state), out[n] = min over top < 2^DN of entry[s >> D] + (value(s) - w)^2, s = top << (16 - DN) | n,
// and the winning top (the lowest on ties) goes to dec as bit planes: plane b of node vector j is dec[j * DN + b]. `values` is blocked for DN: the 2^DN candidates of
// kLanes consecutive nodes are 2^DN consecutive vectors. With many candidates per node each minimum is a long
// dependency chain, so several node groups are interleaved to keep the SIMD units busy.
template <int D, int DN>
void step(const float* values, const float* entry, float w, float* out, Mask* dec) {
  constexpr int low = kStateBits - DN;
  constexpr int block = kLanes << DN;
  constexpr int groups = DN >= 4 ? 4 : 1;
  const vfloat wv = broadcast(w);
  for (int base = 0; base < (1 << low); base += groups * kLanes) {
    const float* v = values + (base / kLanes) * block;
    vfloat best[groups];
    vint arg[groups];
    for (int g = 0; g < groups; ++g) {
      const vfloat diff = load(v + g * block) - wv;
      best[g] = diff * diff + entry_lanes<D>(entry + ((base + g * kLanes) >> D));
      arg[g] = vint{};
    }
    for (int top = 1; top < (1 << DN); ++top) {
      for (int g = 0; g < groups; ++g) {
        const vfloat diff = load(v + g * block + top * kLanes) - wv;
        const vfloat cost = diff * diff + entry_lanes<D>(entry + (top << (low - D)) + ((base + g * kLanes) >> D));
        const vint better = cost < best[g];
        best[g] = better ? cost : best[g];
        arg[g] = better ? vint{} + top : arg[g];
      }
    }
    for (int g = 0; g < groups; ++g) {
      std::memcpy(out + base + g * kLanes, &best[g], sizeof best[g]);
      if (dec != nullptr) {
        Mask* planes = dec + ((base + g * kLanes) / kLanes) * DN;
        for (int b = 0; b < DN; ++b) planes[b] = plane(arg[g], b);
      }
    }
  }
}

using StepFn = void (*)(const float*, const float*, float, float*, Mask*);

// The (D, D(p+1)) pairs EXL3 rates produce: K, K for integer rates; 1..4 alternating for 1.5, 2.5, 3.5.
StepFn step_for(int d, int dn) {
  switch (d * 16 + dn) {
    case 0x11: return step<1, 1>;
    case 0x22: return step<2, 2>;
    case 0x33: return step<3, 3>;
    case 0x44: return step<4, 4>;
    case 0x55: return step<5, 5>;
    case 0x66: return step<6, 6>;
    case 0x77: return step<7, 7>;
    case 0x88: return step<8, 8>;
    case 0x12: return step<1, 2>;
    case 0x21: return step<2, 1>;
    case 0x23: return step<2, 3>;
    case 0x32: return step<3, 2>;
    case 0x34: return step<3, 4>;
    case 0x43: return step<4, 3>;
    default: return nullptr;
  }
}

// The codebook values in the order step<., DN> reads them.
std::vector<float> blocked_values(const float* values, int dn) {
  const int low = kStateBits - dn;
  std::vector<float> table(size_t(1) << kStateBits);
  size_t i = 0;
  for (int base = 0; base < (1 << low); base += kLanes)
    for (int top = 0; top < (1 << dn); ++top)
      for (int l = 0; l < kLanes; ++l) table[i++] = values[(top << low) | (base + l)];
  return table;
}

// Per-thread buffers: two entry-cost arrays (ping-pong) and the decision planes of every position. A
// position with DN new bits has 2^(16 - DN) nodes, so DN * 2^(16 - DN) / kLanes planes: most at the least DN.
struct Workspace {
  explicit Workspace(int min_bits)
      : nodes(size_t(1) << (kStateBits - min_bits)), stride(nodes / kLanes * min_bits), a(nodes + kPad),
        b(nodes + kPad), dec(kPositions * stride) {}
  size_t nodes, stride;
  std::vector<float> a, b;
  std::vector<Mask> dec;
};

class Encoder {
 public:
  // `bits` must be an EXL3 rate's D(p) (see step_for); valid() says whether it was.
  Encoder(const float* values, const int32_t* bits, int seam) : seam_(seam) {
    for (int p = 0; p < kPositions; ++p) d_[p] = bits[p];
    for (int p = 0; p < kPositions; ++p) {
      steps_[p] = step_for(d_[p], next(p));
      if (steps_[p] == nullptr) return;
      if (tables_[next(p)].empty()) tables_[next(p)] = blocked_values(values, next(p));
    }
  }

  bool valid() const { return std::all_of(steps_, steps_ + kPositions, [](StepFn f) { return f != nullptr; }); }

  int min_bits() const { return *std::min_element(d_, d_ + kPositions); }

  // The states of one tile w (256 values in trellis position order).
  void encode(const float* w, Workspace& ws, int32_t* states) const {
    // Pass 1: free start `seam` positions before the ring seam, free end `seam` positions after it.
    float* cur = ws.a.data();
    float* nxt = ws.b.data();
    const int first = kPositions - seam_;
    std::fill(cur, cur + nodes_entering(first), 0.0f);
    for (int i = 0; i < 2 * seam_; ++i) {
      const int p = (first + i) % kPositions;
      run(p, w[p], cur, nxt, i >= seam_ ? decisions(ws, p) : nullptr);
      std::swap(cur, nxt);
    }
    int node = int(std::min_element(cur, cur + nodes_entering(seam_)) - cur);
    for (int p = seam_ - 1; p >= 0; --p) node = state(ws, p, node) >> d_[p];
    const int seam_node = node;
    // Pass 2: the whole ring, leaving from and returning to the seam node.
    std::fill(cur, cur + nodes_entering(0), std::numeric_limits<float>::infinity());
    cur[seam_node] = 0.0f;
    for (int p = 0; p < kPositions; ++p) {
      run(p, w[p], cur, nxt, decisions(ws, p));
      std::swap(cur, nxt);
    }
    for (int p = kPositions - 1; p >= 0; --p) {
      const int s = state(ws, p, node);
      states[p] = s;
      node = s >> d_[p];
    }
  }

 private:
  int next(int p) const { return d_[(p + 1) % kPositions]; }
  int nodes_entering(int p) const { return 1 << (kStateBits - d_[p % kPositions]); }
  void run(int p, float w, const float* entry, float* out, Mask* dec) const {
    steps_[p](tables_[next(p)].data(), entry, w, out, dec);
  }
  static Mask* decisions(Workspace& ws, int p) { return ws.dec.data() + p * ws.stride; }
  // The state chosen at position p on the best path into `node` (a node after p).
  int state(Workspace& ws, int p, int node) const {
    const int dn = next(p);
    const Mask* planes = decisions(ws, p) + (node / kLanes) * dn;
    int top = 0;
    for (int b = 0; b < dn; ++b) top |= ((planes[b] >> (node % kLanes)) & 1) << b;
    return (top << (kStateBits - dn)) | node;
  }

  int seam_;
  int d_[kPositions];
  StepFn steps_[kPositions] = {};
  std::vector<float> tables_[9];  // blocked values per D(p+1)
};

}  // namespace

// states (n, 256) int32 for tiles (n, 256) float32 in trellis position order, with the codebook's 65536
// values, D(p) per position and a pass-1 window of `seam` positions on each side of the ring seam.
// Returns 0; -1 when bits or seam are not valid; -2 when no worker could allocate its buffers.
// Runs on up to `threads` threads, tiles handed out one at a time, so a worker slowed by another process
// delays only its own tile.
extern "C" int exl3_encode_tiles(const float* tiles, int64_t n, const float* values, const int32_t* bits,
                                 int32_t seam, int32_t threads, int32_t* states) {
  if (seam < 1 || seam > kPositions / 2) return -1;
  const Encoder encoder(values, bits, seam);
  if (!encoder.valid()) return -1;
  std::atomic<int64_t> next_tile{0};  // a tile once taken is finished: workers allocate before taking any
  auto work = [&]() {
    try {
      Workspace ws(encoder.min_bits());
      for (int64_t t; (t = next_tile.fetch_add(1)) < n;)
        encoder.encode(tiles + t * kPositions, ws, states + t * kPositions);
    } catch (const std::bad_alloc&) {  // the other workers take the tiles
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int64_t i = 1; i < std::min<int64_t>(threads, n); ++i) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no more threads: the ones started (and this one) do the work
  }
  work();
  for (auto& t : pool) t.join();
  return next_tile.load() >= n ? 0 : -2;
}
