// The project's own Viterbi tile encoder for EXL3 (issue 39; docs/encoder.md, "Our tile kernel").
//
// One 16x16 tile is a tail-biting ring of L = 256 positions. The state after position p is 16 bits; each
// step shifts K new bits in at the bottom, so the cost of a state depends only on its low 16 - K bits
// ("edge" e), and its 2^K predecessors are the states whose top K bits are any k: state s = (k << (16-K)) | e,
// predecessor edge s >> K. The search runs twice, as exllamav3 1.6.5 does (docs/exl3-format.md, encoder):
// pass 1 starts at the ring's middle without constraint and traces back to position 0 to find a boundary
// edge; pass 2 starts at position 0 from that edge and ends in it.
//
// What differs from exllamav3's generic kernel, and why the codes stay the same:
// - every thread owns a fixed run of edges, so the decoded codebook values of its 2^16 / NT states are
//   computed once per kernel launch and kept in registers;
// - the forward pass keeps only the minimum cost per edge (half2 sub, fma, min per pair of edges and
//   candidate), no argmin index; each step's minima go to a global history;
// - the traceback recomputes, for the edge on the path, the 2^K candidate costs with the same fp16 operations
//   (sub, then fma with the stored predecessor cost; a plain square at step 0) and takes the smallest cost,
//   lowest k first: the same value and the same first-index tie rule as a running strict-less argmin;
// - at K 1 and 2, where a step's minima are 64 and 32 KiB and writing them bounds the search, the history
//   keeps every other step's only; the traceback recomputes a skipped step's minimum from the step before
//   it with the forward pass's operations (a minimum of the same values in any order is the same value);
// - the minima are placed to avoid shared-memory bank conflicts (cost_slot) and to coalesce the history
//   writes (hist_slot): places change, values do not;
// - a block keeps two tiles in flight, so that each traceback runs beside the next forward pass (see the
//   kernel); each tile's search is unchanged;
// - the reconstructed values are decoded from the written states once a block's tiles are done, not by the
//   traceback as it goes.
// The final-edge choice after pass 1 uses exllamav3's tie order over equal costs (bit-reversed warp, then
// bit-reversed lane, then 1024-state stripe), written out below as `edge_rank`.

//
// The per-thread work (decode, one forward step, the final-edge key, one traceback candidate) is written as
// plain functions and the kernel only orders them between barriers. Built with TRELLIS_HOST defined (and a
// host definition of the fp16 types and intrinsics, tests/encoder_kernel_host.cpp), the same functions run
// on a CPU, one simulated thread after another, so the search can be checked without a GPU.

#ifdef TRELLIS_HOST
#define TE_FN inline
#else
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#define TE_FN __device__ __forceinline__
#endif
#include <cstdint>

namespace trellis {

constexpr int L = 256;          // positions per tile (ring)
constexpr int NT = 512;         // threads per block; all run the forward pass, warp 0 also traces back
constexpr uint32_t NO_KEY = 0xffffffffu;

template <int K>
struct Geometry
{
    static constexpr int EDGES = 65536 >> K;                  // cost entries per step
    static constexpr int E = EDGES / NT;                      // edges per thread, a contiguous run
    static constexpr int P = E / 2;                           // edge pairs (one half2 each)
    static constexpr int Q = 1 << K;                          // predecessors per edge
    static constexpr int KSHIFT = 16 - 2 * K;                 // where k sits in a predecessor edge
    static constexpr int G = (E >> K) > 0 ? (E >> K) : 1;     // distinct predecessor groups (e >> K) per thread
    static constexpr int STRIDE = K <= 2 ? 2 : 1;             // the history keeps every STRIDE-th step's minima
    static constexpr int ROWS = L / STRIDE;                   // history rows per block
    static constexpr int NV = STRIDE == 2 ? Q : 1;            // history minima a traceback candidate reads
    static constexpr int R = (Q + 31) / 32;                   // traceback candidates per lane of warp 0
    static constexpr int PARTS = K == 1 ? 2 : 1;              // pieces of a run per forward step
    static constexpr int UNITS = E / 8;                       // 16-byte units in a thread's run of minima
    static constexpr int SPREAD = UNITS >= 8 ? 0 : UNITS == 4 ? 1 : 2;  // log2(8 / UNITS), see cost_slot
    static_assert(E >= 2 && (E % 2) == 0 && KSHIFT >= 0, "K outside this thread layout");
};

// Codebooks (docs/exl3-format.md, decode step 4): 0 = 3INST, 1 = mcg, 2 = mul1
template <int CB>
TE_FN half decode_state(uint32_t s)
{
    if constexpr (CB == 2)
    {
        const uint32_t x = s * 0x83DCD12Du;
        const uint32_t bytes = (x & 0xffu) + ((x >> 8) & 0xffu) + ((x >> 16) & 0xffu) + (x >> 24);
        // 0x6400 + c is the fp16 bit pattern of 1024 + c (c <= 1020); one fused rounding
        const half h = __ushort_as_half((unsigned short) (0x6400u + bytes));
        return __hfma(h, __ushort_as_half(0x1eee), __ushort_as_half(0xc931));
    }
    else
    {
        uint32_t x = CB == 1 ? s * 0xCBAC1FEDu : s * 89226354u + 64248484u;
        x = (x & 0x8fff8fffu) ^ 0x3b603b60u;
        return __hadd(__ushort_as_half((unsigned short) (x & 0xffffu)), __ushort_as_half((unsigned short) (x >> 16)));
    }
}

TE_FN half inf_half() { return __ushort_as_half(0x7c00); }

// N / 2 pairs of consecutive halves from shared memory into registers (N even), in the widest aligned pieces
template <int N>
TE_FN void load_pairs(half2* dst, const half* src)
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < N / 2; ++i) dst[i] = __halves2half2(src[2 * i], src[2 * i + 1]);
#else
    if constexpr (N % 8 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 8; ++i)
            *reinterpret_cast<uint4*>(&dst[4 * i]) = reinterpret_cast<const uint4*>(src)[i];
    }
    else if constexpr (N % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 4; ++i)
            *reinterpret_cast<uint2*>(&dst[2 * i]) = reinterpret_cast<const uint2*>(src)[i];
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < N / 2; ++i) dst[i] = reinterpret_cast<const half2*>(src)[i];
    }
#endif
}

template <int P>
TE_FN void store_pairs(half* dst, const half2 (&src)[P])
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < P; ++i) { dst[2 * i] = __low2half(src[i]); dst[2 * i + 1] = __high2half(src[i]); }
#else
    if constexpr (P % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 4; ++i)
            reinterpret_cast<uint4*>(dst)[i] = *reinterpret_cast<const uint4*>(&src[4 * i]);
    }
    else if constexpr (P % 2 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 2; ++i)
            reinterpret_cast<uint2*>(dst)[i] = *reinterpret_cast<const uint2*>(&src[2 * i]);
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < P; ++i) reinterpret_cast<half2*>(dst)[i] = src[i];
    }
#endif
}

// Where edge e's minimum sits in the shared cost buffers. A thread stores its run of E minima as UNITS
// 16-byte units, and a warp stores 16-byte pieces eight threads at a time: where a run is 2, 4 or 8 units
// (K 3, 2, 1) those eight threads' pieces would fall in 4, 2 or 1 of the 8 bank groups, so every store
// would wait 2, 4 or 8 times over. Each thread's units are therefore XOR-permuted by its index, spreading
// the eight threads over all 8 groups; loads of any aligned run of 8 units stay within one permuted run.
// Only the place changes, never a value (the history in global memory has its own order, hist_slot).
template <int K>
TE_FN int cost_slot(int e)
{
    using Gm = Geometry<K>;
    if constexpr (Gm::UNITS < 2) return e;
    else
    {
        const int unit = e >> 3;
        const int owner = unit / Gm::UNITS;
        return ((unit ^ ((owner >> Gm::SPREAD) & (Gm::UNITS - 1))) << 3) | (e & 7);
    }
}

// N minima of consecutive edges from `start` (N a power of two; aligned runs never straddle a unit) out of
// a shared cost buffer, as N / 2 pairs (one unit or less at a time), or where N is 1 as that minimum twice
template <int K, int N>
TE_FN void load_cost_pairs(half2 (&dst)[(N + 1) / 2], const half* costs, int start)
{
    if constexpr (N == 1)
    {
        dst[0] = __half2half2(costs[cost_slot<K>(start)]);
    }
    else
    {
        constexpr int PIECE = N < 8 ? N : 8;
        #pragma unroll
        for (int i = 0; i < N / PIECE; ++i) load_pairs<PIECE>(&dst[PIECE / 2 * i], costs + cost_slot<K>(start + PIECE * i));
    }
}

// Where edge x's minimum sits in a history row (global memory). Stored in a thread's plain order, each of a
// warp's 16-byte stores would touch 32 separate lines wherever a run is 2 units or more (K 1-3): cutting
// the history writes out of the kernel made it 3.5x faster at K 1 and 1.6x at K 2 (H100). So a row is laid
// out unit-major: unit 0 of every thread's run, then unit 1, ..., and each warp store writes 512
// contiguous bytes. The traceback reads single minima, through this same map.
template <int K>
TE_FN int hist_slot(int x)
{
    using Gm = Geometry<K>;
    if constexpr (Gm::UNITS < 2) return x;
    else
    {
        const int unit = x >> 3;
        return (((unit % Gm::UNITS) * NT + unit / Gm::UNITS) << 3) | (x & 7);
    }
}

// Thread t's P pairs of minima from its pair p0 on into a history row, in hist_slot's order
template <int K, int P>
TE_FN void store_history(half* row, int t, const half2 (&src)[P], int p0 = 0)
{
    using Gm = Geometry<K>;
    if constexpr (Gm::UNITS < 2) store_pairs<P>(row + t * Gm::E + 2 * p0, src);
    else
    {
        #pragma unroll
        for (int c = 0; c < P / 4; ++c)
        {
            alignas(16) half2 piece[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) piece[j] = src[4 * c + j];
            store_pairs<4>(row + (((p0 / 4 + c) * NT + t) << 3), piece);
        }
    }
}

// Thread t's P pairs of minima into a shared cost buffer, one unit (or less) at a time
template <int K, int P>
TE_FN void store_costs(half* costs, int e0, const half2 (&src)[P])
{
    constexpr int PIECE = P < 4 ? P : 4;  // pairs per store
    #pragma unroll
    for (int i = 0; i < P / PIECE; ++i)
    {
        alignas(16) half2 piece[PIECE];
        #pragma unroll
        for (int j = 0; j < PIECE; ++j) piece[j] = src[PIECE * i + j];
        store_pairs<PIECE>(costs + cost_slot<K>(e0 + 2 * PIECE * i), piece);
    }
}

TE_FN uint32_t rev5(uint32_t x)
{
#ifdef TRELLIS_HOST
    uint32_t r = 0;
    for (int b = 0; b < 5; ++b) r |= ((x >> b) & 1u) << (4 - b);
    return r;
#else
    return __brev(x) >> 27;
#endif
}

// The tie order over equal final costs: an edge's rank (unique, 16 bits), and back
TE_FN uint32_t edge_rank(uint32_t e)
{
    const uint32_t low = e & 1023u;
    return (rev5(low >> 5) << 10) | (rev5(low & 31u) << 5) | (e >> 10);
}
TE_FN uint32_t rank_edge(uint32_t r)
{
    return ((r & 31u) << 10) | (rev5(r >> 10) << 5) | rev5((r >> 5) & 31u);
}

// Thread t's decoded values: dec[k][j] holds the states (k << (16-K)) | e for its edge pair j
template <int K, int CB>
TE_FN void decode_thread(int t, half2 (&dec)[Geometry<K>::Q][Geometry<K>::P])
{
    using Gm = Geometry<K>;
    const int e0 = t * Gm::E;
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        #pragma unroll
        for (int j = 0; j < Gm::P; ++j)
        {
            const uint32_t s = ((uint32_t) k << (16 - K)) | (uint32_t) (e0 + 2 * j);
            dec[k][j] = __halves2half2(decode_state<CB>(s), decode_state<CB>(s + 1));
        }
    }
}

// One forward step for thread t: the minimum over the 2^K predecessors of every edge it owns, into `next`
// (and `hrow` when not null). FIRST: the first step of a pass, a plain square, only from edge `pre` if >= 0
// (`prev` unused); a template argument, so that the other 255 steps run without a branch per candidate and
// take each predecessor cost straight from the loaded pair (docs/encoder.md, "What limited it next"). At K 1
// the run is done in PARTS pieces, each with its own minima and predecessor costs: a whole run's do not fit
// in the registers beside the decoded values and the traceback's (the compiler spilled them)
template <int K, bool FIRST>
TE_FN void forward_thread(int t, const half2 (&dec)[Geometry<K>::Q][Geometry<K>::P], half w, const half* prev,
                          half* next, half* hrow, int pre)
{
    using Gm = Geometry<K>;
    constexpr int PP = Gm::P / Gm::PARTS;   // edge pairs per part
    constexpr int PG = Gm::G / Gm::PARTS;   // predecessor costs per part and k (G is a multiple of PARTS)
    const half2 w2 = __half2half2(w);
    #pragma unroll
    for (int part = 0; part < Gm::PARTS; ++part)
    {
        const int p0 = part * PP;             // the part's first pair
        const int e = t * Gm::E + 2 * p0;     // and its first edge (a multiple of 2^K)
        alignas(16) half2 m[PP];  // aligned for the vector stores of store_costs
        #pragma unroll
        for (int k = 0; k < Gm::Q; ++k)
        {
            alignas(16) half2 c[(PG + 1) / 2];  // aligned for the vector loads of load_pairs
            if constexpr (!FIRST) load_cost_pairs<K, PG>(c, prev, (k << Gm::KSHIFT) | (e >> K));
            #pragma unroll
            for (int j = 0; j < PP; ++j)
            {
                const half2 d = __hsub2(dec[k][p0 + j], w2);
                half2 v;
                if constexpr (FIRST)
                {
                    v = __hmul2(d, d);
                    if (pre >= 0 && ((k << Gm::KSHIFT) | ((e + 2 * j) >> K)) != pre) v = __half2half2(inf_half());
                }
                else
                {
                    // edges 2j and 2j + 1 share their predecessor: cost (2j) >> K of the run, both halves
                    const int ci = PG == 1 ? 0 : (2 * j) >> K;
                    v = __hfma2(d, d, (ci & 1) ? __high2half2(c[ci >> 1]) : __low2half2(c[ci >> 1]));
                }
                m[j] = k == 0 ? v : __hmin2(m[j], v);
            }
        }
        store_costs<K, PP>(next, e, m);
        if (hrow) store_history<K, PP>(hrow, t, m, p0);
    }
}

// Thread t's smallest (cost bits << 16 | rank) over its edges of the final step
template <int K>
TE_FN uint32_t final_key_thread(int t, const half* costs)
{
    using Gm = Geometry<K>;
    const int e0 = t * Gm::E;
    uint32_t best = NO_KEY;
    #pragma unroll
    for (int j = 0; j < Gm::E; ++j)
    {
        const uint32_t e = (uint32_t) (e0 + j);
        const uint32_t key = ((uint32_t) __half_as_ushort(costs[cost_slot<K>((int) e)]) << 16) | edge_rank(e);
        best = key < best ? key : best;
    }
    return best;
}

// The final edge from the block's smallest key; every cost infinite: edge 0, as exllamav3 does
TE_FN int final_edge(uint32_t best) { return best >= 0x7c000000u ? 0 : (int) rank_edge(best & 0xffffu); }

// The history row that keeps step i's minima, or -1 for a step it skips (STRIDE 2: the even ones)
template <int K>
TE_FN int history_row(int i) { return Geometry<K>::STRIDE == 1 ? i : ((i & 1) ? (i >> 1) : -1); }

// The history minima the traceback needs for candidate k of edge e at position i (see candidate_key): step
// i - 1's minimum of the candidate's predecessor edge, or where the history skips step i - 1, step i - 2's
// minima of that edge's 2^K predecessors (none at i = 0, nor where step i - 1 is step 0). Gathered apart from
// the arithmetic, so that the kernel can load them one forward step before it needs them
template <int K>
TE_FN void gather_candidate(uint32_t k, uint32_t e, int i, const half* hist, half (&v)[Geometry<K>::NV])
{
    using Gm = Geometry<K>;
    if (i == 0) return;
    const uint32_t in = (((uint32_t) k << (16 - K)) | e) >> K;
    const int r = i - 1;
    if (history_row<K>(r) >= 0)
    {
        v[0] = hist[(size_t) history_row<K>(r) * Gm::EDGES + hist_slot<K>((int) in)];
        return;
    }
    if constexpr (Gm::NV > 1)
    {
        if (r == 0) return;
        #pragma unroll
        for (int j = 0; j < Gm::Q; ++j)
            v[j] = hist[(size_t) history_row<K>(r - 1) * Gm::EDGES + hist_slot<K>((int) ((((uint32_t) j << (16 - K)) | in) >> K))];
    }
}

// The minimum cost of edge x after step r as the forward pass computed it, from the gathered minima: the
// kept one, or for a step the history skips, recomputed over x's 2^K predecessors (a plain square at step 0)
template <int K, int CB>
TE_FN half step_cost(uint32_t x, int r, half w_r, int pre, const half (&v)[Geometry<K>::NV])
{
    using Gm = Geometry<K>;
    if (history_row<K>(r) >= 0) return v[0];
    half m = inf_half();
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        const uint32_t s = ((uint32_t) k << (16 - K)) | x;
        const half d = __hsub(decode_state<CB>(s), w_r);
        half c;
        if (r == 0)
        {
            c = __hmul(d, d);
            if (pre >= 0 && (int) (s >> K) != pre) c = inf_half();
        }
        else
        {
            c = __hfma(d, d, v[Gm::NV > 1 ? k : 0]);
        }
        m = k == 0 ? c : __hmin(m, c);
    }
    return m;
}

// Traceback, candidate k of edge e at position index i: its decoded value less the position's weight, the
// part that needs no history (the kernel computes it before the forward work, the rest after)
template <int K, int CB>
TE_FN half candidate_offset(int k, uint32_t e, half w)
{
    return __hsub(decode_state<CB>(((uint32_t) k << (16 - K)) | e), w);
}

// and its key (cost bits << 16 | k), recomputed with the forward pass's operations from that offset d and
// step i - 1's minima, gathered into v (`w_prev`: that step's weight; unused at i = 0)
template <int K, int CB>
TE_FN uint32_t candidate_key(int k, uint32_t e, half d, int i, int pre, const half (&v)[Geometry<K>::NV], half w_prev)
{
    const uint32_t in = (((uint32_t) k << (16 - K)) | e) >> K;
    half c;
    if (i == 0)
    {
        c = __hmul(d, d);
        if (pre >= 0 && (int) in != pre) c = inf_half();
    }
    else
    {
        c = __hfma(d, d, step_cost<K, CB>(in, i - 1, w_prev, pre, v));
    }
    return ((uint32_t) __half_as_ushort(c) << 16) | (uint32_t) k;
}

TE_FN uint32_t state_of(uint32_t best, uint32_t e, int K) { return ((best & 0xffffu) << (16 - K)) | e; }

TE_FN int ring(int i, int roll) { return i + roll >= L ? i + roll - L : i + roll; }

// Which steps' minima the traceback reads: pass 1 (roll L/2) traces back to ring position 0, index L/2,
// and reads steps L/2 - 1 .. L - 2; pass 2 reads steps 0 .. L - 2. The history keeps those of them that
// history_row gives a row (L/2 - 1 is odd, so pass 1's first read step is kept at either stride)
template <int K>
TE_FN half* kept_row(half* hist, int i, int keep_from)
{
    return i >= keep_from && i <= L - 2 && history_row<K>(i) >= 0
        ? hist + (size_t) history_row<K>(i) * Geometry<K>::EDGES : nullptr;
}

#ifndef TRELLIS_HOST

// A traceback waiting for a forward pass (in shared memory), or running in one (warp 0's registers)
struct Trace
{
    int active;  // 0: none
    int slot;    // the tile buffer that holds its weights
    int roll;    // L/2 for pass 1, 0 for pass 2
    int pre;     // pass 2: the boundary edge; pass 1: -1
    int e;       // the edge at its next position
    int buf;     // the history buffer it reads
    int tile;    // pass 2: the tile whose states it writes; pass 1: -1 (it yields the boundary)
};

// One block encodes its tiles two at a time, so that every traceback runs beside a forward pass instead of
// after it (tracebacks were a third of the kernel's time at K 2-4 on an H100: bench/encoder_kernel.py, with
// them cut out). Per pair of tiles a, b the forward passes run F1(a), F1(b), F2(a), F2(b), and during each one
// warp 0 follows the traceback of the pass before it: T2 of the previous pair's b, T1(a), T1(b), T2(a); T2(b)
// runs beside the next pair's F1(a). Each traceback position gathers its history minima before warp 0's
// forward work and resolves after it, so the loads' latency is hidden too. Forward passes write the two
// history buffers in turn, and a traceback reads the one the pass before wrote. A last tile without a pair
// traces its pass 1 back on its own; the block's last pass 2 is traced after the loop.
template <int K, int CB>
__global__ void __launch_bounds__(NT, 1)
trellis_encode_kernel(const float* __restrict__ tiles, float* __restrict__ out_values,
                      int16_t* __restrict__ out_states, half* __restrict__ history, int num_tiles)
{
    using Gm = Geometry<K>;
    constexpr size_t HSIZE = (size_t) Gm::ROWS * Gm::EDGES;    // one history buffer
    extern __shared__ __align__(16) uint8_t smem[];
    half* costs0 = reinterpret_cast<half*>(smem);
    half* costs1 = costs0 + Gm::EDGES;
    half* sh_w = costs1 + Gm::EDGES;                             // two tiles in fp16, one per slot
    uint32_t* sh_red = reinterpret_cast<uint32_t*>(sh_w + 2 * L);   // one word per warp
    int* sh_bound = reinterpret_cast<int*>(sh_red + NT / 32);     // the boundary edge of each slot's tile
    Trace* sh_tr = reinterpret_cast<Trace*>(sh_bound + 2);

    const int t = threadIdx.x;
    const int lane = t & 31;
    half* hists = history + (size_t) blockIdx.x * 2 * HSIZE;
    const int count = num_tiles > (int) blockIdx.x ? (num_tiles - 1 - (int) blockIdx.x) / (int) gridDim.x + 1 : 0;
    auto tile_of = [&](int n) { return (int) blockIdx.x + n * (int) gridDim.x; };

    // Decoded values of this thread's states, kept for every step of every tile
    half2 dec[Gm::Q][Gm::P];
    decode_thread<K, CB>(t, dec);
    if (t == 0) sh_tr->active = 0;

    // Warp 0 takes the pending traceback into its registers (where it stays while it runs: nothing else reads
    // it) and marks the shared copy taken
    auto tb_take = [&]()
    {
        const Trace tr = *sh_tr;
        __syncwarp();
        if (lane == 0) sh_tr->active = 0;
        return tr;
    };
    // Warp 0, before its forward work: the history minima of the traceback's position for forward step j
    // (position L-1-j) and the candidates' offsets, everything that does not wait for those loads
    auto tb_gather = [&](const Trace& tr, int j, half (&v)[Gm::R][Gm::NV], half (&d)[Gm::R])
    {
        const half* hist = hists + tr.buf * HSIZE;
        const half wi = sh_w[tr.slot * L + ring(L - 1 - j, tr.roll)];
        #pragma unroll
        for (int r = 0; r < Gm::R; ++r)
        {
            const int k = lane + 32 * r;
            if (k < Gm::Q)
            {
                gather_candidate<K>((uint32_t) k, (uint32_t) tr.e, L - 1 - j, hist, v[r]);
                d[r] = candidate_offset<K, CB>(k, (uint32_t) tr.e, wi);
            }
        }
    };
    // Warp 0, after it: that position's least candidate (first on ties), its state written in pass 2, the
    // edge before it kept for the next position; pass 1 stops at ring position 0 with the boundary edge
    auto tb_resolve = [&](Trace& tr, int j, const half (&v)[Gm::R][Gm::NV], const half (&d)[Gm::R])
    {
        const int i = L - 1 - j;
        const int ri = ring(i, tr.roll);
        const half w_prev = Gm::NV > 1 ? sh_w[tr.slot * L + ring(i > 0 ? i - 1 : 0, tr.roll)] : half();
        uint32_t best = NO_KEY;
        #pragma unroll
        for (int r = 0; r < Gm::R; ++r)
        {
            const int k = lane + 32 * r;
            if (k < Gm::Q) best = min(best, candidate_key<K, CB>(k, (uint32_t) tr.e, d[r], i, tr.pre, v[r], w_prev));
        }
        best = __reduce_min_sync(0xffffffffu, best);
        const uint32_t s = state_of(best, (uint32_t) tr.e, K);
        tr.e = (int) (s >> K);
        if (lane == 0 && tr.tile >= 0) out_states[(size_t) tr.tile * L + ri] = (int16_t) (uint16_t) s;
        if (tr.tile < 0 && ri == 0)
        {
            if (lane == 0) sh_bound[tr.slot] = tr.e;
            tr.active = 0;
        }
        else if (i == 0)
        {
            tr.active = 0;
        }
    };

    int buf = 0;  // the history buffer the next forward pass writes

    // A forward pass over all L steps of the tile in `slot` (ring rolled by `roll`), from edge `pre` if >= 0,
    // keeping the history rows of steps from keep_from on; warp 0 follows the pending traceback beside it.
    // The last step's minima end in costs1 (L is even)
    auto forward = [&](int slot, int roll, int pre, int keep_from)
    {
        half* hist = hists + buf * HSIZE;
        const half* w = sh_w + slot * L;
        Trace tr{};
        if (t < 32) tr = tb_take();
        for (int j = 0; j < L; ++j)
        {
            half v[Gm::R][Gm::NV], d[Gm::R];
            if (t < 32 && tr.active) tb_gather(tr, j, v, d);
            half* next = (j & 1) ? costs1 : costs0;
            half* hrow = kept_row<K>(hist, j, keep_from);
            if (j == 0) forward_thread<K, true>(t, dec, w[ring(j, roll)], nullptr, next, hrow, pre);
            else forward_thread<K, false>(t, dec, w[ring(j, roll)], (j & 1) ? costs0 : costs1, next, hrow, pre);
            if (t < 32 && tr.active) tb_resolve(tr, j, v, d);
            __syncthreads();
        }
    };
    // The pending traceback alone, where no forward pass is left to run beside it
    auto drain = [&]()
    {
        if (t < 32)
        {
            Trace tr = tb_take();
            for (int j = 0; j < L && tr.active; ++j)
            {
                half v[Gm::R][Gm::NV], d[Gm::R];
                tb_gather(tr, j, v, d);
                tb_resolve(tr, j, v, d);
            }
        }
        __syncthreads();
    };
    // After pass 1 of the tile in `slot`: its traceback is pending, from the final edge of least cost
    auto pass1_done = [&](int slot)
    {
        uint32_t best = __reduce_min_sync(0xffffffffu, final_key_thread<K>(t, costs1));
        if (lane == 0) sh_red[t >> 5] = best;
        __syncthreads();
        if (t < 32)
        {
            best = __reduce_min_sync(0xffffffffu, lane < NT / 32 ? sh_red[lane] : NO_KEY);
            if (lane == 0) *sh_tr = Trace{1, slot, L / 2, -1, final_edge(best), buf, -1};
        }
        buf ^= 1;
        __syncthreads();
    };
    // After pass 2 of tile n in `slot`: its traceback is pending, from and to its boundary edge
    auto pass2_done = [&](int slot, int n)
    {
        if (t == 0) *sh_tr = Trace{1, slot, 0, sh_bound[slot], sh_bound[slot], buf, tile_of(n)};
        buf ^= 1;
        __syncthreads();
    };
    auto load_tile = [&](int slot, int n)
    {
        const float* in = tiles + (size_t) tile_of(n) * L;
        for (int i = t; i < L; i += NT) sh_w[slot * L + i] = __float2half_rn(in[i]);
        __syncthreads();
    };

    for (int n = 0; n < count; n += 2)
    {
        load_tile(0, n);                    // slot 0's last traceback (T2 of tile n - 2) ran beside F2(n - 1)
        forward(0, L / 2, -1, L / 2 - 1);   // F1(n), beside T2(n - 1)
        pass1_done(0);
        if (n + 1 < count)
        {
            load_tile(1, n + 1);            // T2(n - 1) ran beside F1(n)
            forward(1, L / 2, -1, L / 2 - 1);   // F1(n + 1), beside T1(n)
            pass1_done(1);
            forward(0, 0, sh_bound[0], 0);      // F2(n), beside T1(n + 1)
            pass2_done(0, n);
            forward(1, 0, sh_bound[1], 0);      // F2(n + 1), beside T2(n)
            pass2_done(1, n + 1);
        }
        else
        {
            drain();                            // T1(n)
            forward(0, 0, sh_bound[0], 0);      // F2(n)
            pass2_done(0, n);
        }
    }
    drain();

    // The reconstructed values of the states the tracebacks wrote (apart from them, so that no traceback
    // position waits on a decode and a store; the barrier in drain makes the states visible to the block)
    for (int n = 0; n < count; ++n)
        for (int i = t; i < L; i += NT)
        {
            const size_t at = (size_t) tile_of(n) * L + i;
            out_values[at] = __half2float(decode_state<CB>((uint32_t) (uint16_t) out_states[at]));
        }
}

#endif  // !TRELLIS_HOST
}  // namespace trellis

#ifndef TRELLIS_HOST
namespace {

using namespace trellis;

template <int K, int CB>
void launch(const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t max_blocks)
{
    constexpr int EDGES = Geometry<K>::EDGES;
    constexpr int ROWS = Geometry<K>::ROWS;  // a plain constant: a dependent one would make `history` a dependent type
    const int num_tiles = (int) tiles.size(0);
    if (num_tiles == 0) return;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    int blocks = std::min(num_tiles, sms);
    if (max_blocks > 0) blocks = (int) std::min<int64_t>(blocks, max_blocks);
    auto history = torch::empty({(int64_t) blocks * 2 * ROWS * EDGES}, tiles.options().dtype(torch::kHalf));
    const size_t shmem = (2 * EDGES + 2 * L) * sizeof(half) + (NT / 32 + 2) * sizeof(uint32_t) + sizeof(Trace);
    auto kernel = trellis_encode_kernel<K, CB>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shmem));
    kernel<<<blocks, NT, shmem, at::cuda::getCurrentCUDAStream()>>>(
        tiles.data_ptr<float>(), values.data_ptr<float>(), states.data_ptr<int16_t>(),
        reinterpret_cast<half*>(history.data_ptr<at::Half>()), num_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int K>
void launch_cb(int64_t cb, const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t mb)
{
    switch (cb)
    {
        case 0: launch<K, 0>(tiles, values, states, mb); break;
        case 1: launch<K, 1>(tiles, values, states, mb); break;
        case 2: launch<K, 2>(tiles, values, states, mb); break;
        default: TORCH_CHECK(false, "trellis_encode: codebook must be 0 (3INST), 1 (mcg) or 2 (mul1), got ", cb);
    }
}

}  // namespace

// tiles: (N, 256) float32, contiguous, on a CUDA device. Returns (values float32 (N, 256), states int16 (N, 256)).
std::vector<torch::Tensor> encode_tiles(torch::Tensor tiles, int64_t K, int64_t cb, int64_t max_blocks)
{
    TORCH_CHECK(tiles.is_cuda() && tiles.scalar_type() == torch::kFloat && tiles.dim() == 2 && tiles.size(1) == L
                && tiles.is_contiguous(), "trellis_encode: tiles must be a contiguous CUDA float32 (N, 256) tensor");
    const c10::cuda::CUDAGuard guard(tiles.device());
    auto values = torch::empty_like(tiles);
    auto states = torch::empty(tiles.sizes(), tiles.options().dtype(torch::kShort));
    switch (K)
    {
        case 1: launch_cb<1>(cb, tiles, values, states, max_blocks); break;
        case 2: launch_cb<2>(cb, tiles, values, states, max_blocks); break;
        case 3: launch_cb<3>(cb, tiles, values, states, max_blocks); break;
        case 4: launch_cb<4>(cb, tiles, values, states, max_blocks); break;
        case 5: launch_cb<5>(cb, tiles, values, states, max_blocks); break;
        case 6: launch_cb<6>(cb, tiles, values, states, max_blocks); break;
        default: TORCH_CHECK(false, "trellis_encode: K must be 1..6, got ", K);
    }
    return {values, states};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("encode_tiles", &encode_tiles, "Viterbi encode of 16x16 EXL3 tiles (docs/encoder.md)");
}
#endif  // !TRELLIS_HOST
