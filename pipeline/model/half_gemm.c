/* A CPU step's few rows in C (pipeline/model/native.py): `half_gemm` (below), `rms_norm`,
 * `attend` (RoPE, KV-cache write, attention), `decoder_layer` (a whole layer), `mtp_forward`
 * (an MTP head) and `mtp_greedy` (a head's greedy drafts); `decoder_stack`: a target's layers;
 * `greedy_head`: a greedy verify's output linear, argmax and acceptance.
 *
 * half_gemm: y[m, n] = x[m, k] @ W[n, k]^T (+ b) for a few rows m, W stored as float16 in panels of 64
 * output columns, [n / 64][k][64]: a panel is read once, front to back, for up to RB rows at a
 * time, each float16 weight widened to float32 in registers; products and sums in float32 (FMA),
 * so it is the float32 linear of a weight float16 holds, in another summation order.
 *
 * Why: at batch 1 a CPU step's linears are bound by reading their weights, and torch's kernels
 * (MKL float32, FBGEMM float16) cost 1.5-2.2x as much at 6 rows as at 1. Here a step of 6 rows
 * does 24 FMAs per 128 bytes of weight read, and prefetching PREFETCH rows of the panel ahead
 * keeps the reads streaming, so 6 rows cost about what 1 does (pipeline/model/native.py).
 *
 * Compiled on the running machine by pipeline/model/native.py (-O3 -march=native
 * -ffp-contract=off) for AVX-512 or AVX2 (the vector layer below); elsewhere it does not
 * compile and the engine keeps torch's kernels. */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <stdint.h>

/* The vector layer: the kernels below are written once over `vf` (VW float32 lanes), `vi` (VW
 * int32 lanes) and `vm` (a lane mask), which map to AVX-512 (16 lanes; F, BW and VL, as on
 * Intel Skylake-SP and later, AMD Zen 4) or to AVX2 with FMA and F16C (8 lanes; Intel Haswell
 * and later, AMD Zen 1-3). RB: rows per pass over a weight panel; NV(m): vectors of output
 * columns per pass at m rows, so that RB x NV accumulators, the weights and the rows' broadcasts
 * fit the vector registers (32 with AVX-512, 16 with AVX2); XFIRST(m, nv): hold the m rows'
 * broadcasts and load a weight vector at a time, where that fits the registers and holding nv
 * weights would not (gcc spills accumulators otherwise). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VW 16
#define RB 8              /* 8 x 4 accumulators: measured no slower than 6-row passes at 1-6 rows,
                             1.1-1.65x faster at 7-8 (docs/decisions.md, stop 49) */
#define NV(m) 4
#define XFIRST(m, nv) 0   /* the weights held: 32 registers hold 8 x 4 accumulators */
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vm;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vhalf(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline vm vfirst(int n) { return n >= 16 ? (vm)0xFFFF : n <= 0 ? (vm)0 : (vm)((1u << n) - 1); }
static inline vm vm_and(vm a, vm b) { return a & b; }
static inline vm vm_or(vm a, vm b) { return a | b; }
static inline vf vload_m(vm m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vstore_m(float *p, vm m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vf vsel(vm m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); }
static inline vm vneq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
static inline int veq_bits(vf a, vf b) { return (int)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vi iset(int a) { return _mm512_set1_epi32(a); }
static inline vi ilane(void) { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
static inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi imul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vm ieq(vi a, vi b) { return _mm512_cmpeq_epi32_mask(a, b); }
static inline vm ile(vi a, vi b) { return _mm512_cmple_epi32_mask(a, b); }
static inline vm ige(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
/* lane k = the sum of v[k]'s lanes, for VW vectors: a tree of lane shuffles and adds (46 ops
 * where 16 reductions take ~130); lane k of the last level holds v[4 (k % 4) + k / 4]'s sum */
static inline vf vtsum(const vf *v) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
    vf d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), d);
}
/* lanes below n whose byte p[lane] is not 0 */
static inline vm vbytes(const uint8_t *p, int n) {
    vm m = vfirst(n);
    return m & _mm_test_epi8_mask(_mm_maskz_loadu_epi8(m, p), _mm_set1_epi8(-1));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VW 8
#define RB 6              /* 6 x 16 columns: 12 accumulators, 2 weights, a broadcast */
#define NV(m) ((m) <= 2 ? 8 : (m) <= 4 ? 4 : 2)  /* measured on Zen 3: docs/decisions.md, stop 51 */
/* Hold the rows' broadcasts where holding nv weights would spill accumulators and the
 * broadcasts fit: 3 rows x 4 vectors (12 + 3 + 1 registers) */
#define XFIRST(m, nv) ((m) > 1 && (m) * (nv) + (nv) + 1 > 16 && (m) * (nv) + (m) + 1 <= 16)
typedef __m256 vf;
typedef __m256i vi;
typedef __m256i vm;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vhalf(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n for integral n in [-126, 127]: n added to the exponent field of 1.0 */
static inline vf vscale2(vf p, vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vi iset(int a) { return _mm256_set1_epi32(a); }
static inline vi ilane(void) { return _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0); }
static inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi imul(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
static inline vm vfirst(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), ilane()); }
static inline vm vm_and(vm a, vm b) { return _mm256_and_si256(a, b); }
static inline vm vm_or(vm a, vm b) { return _mm256_or_si256(a, b); }
static inline vf vload_m(vm m, const float *p) { return _mm256_maskload_ps(p, m); }
static inline void vstore_m(float *p, vm m, vf v) { _mm256_maskstore_ps(p, m, v); }
static inline vf vsel(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
static inline vm vneq(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_NEQ_OQ)); }
static inline int veq_bits(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline vm vlt(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vm ieq(vi a, vi b) { return _mm256_cmpeq_epi32(a, b); }
static inline vm ile(vi a, vi b) { return _mm256_xor_si256(_mm256_cmpgt_epi32(a, b), _mm256_set1_epi32(-1)); }
static inline vm ige(vi a, vi b) { return _mm256_xor_si256(_mm256_cmpgt_epi32(b, a), _mm256_set1_epi32(-1)); }
/* lane k = the sum of v[k]'s lanes, for VW vectors (horizontal adds, then the halves) */
static inline vf vtsum(const vf *v) {
    vf lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    vf hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
/* lanes below n whose byte p[lane] is not 0 (reads only p[0..n-1]) */
static inline vm vbytes(const uint8_t *p, int n) {
    uint8_t b[8] = {0};
    memcpy(b, p, n < 8 ? (size_t)n : 8);
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    return _mm256_xor_si256(_mm256_cmpeq_epi32(v, _mm256_setzero_si256()), _mm256_set1_epi32(-1));
}
#else
#error "half_gemm needs AVX-512 (F, BW, VL) or AVX2 with FMA and F16C"
#endif

#define PANEL 64          /* output columns per panel (pipeline/model/native.py packs them) */
#define PREFETCH 64       /* panel rows (128 bytes each) read ahead: 8 KB, about what memory has in
                             flight at its latency; a step at 1-2 rows 0.88-0.93x 16 rows' time
                             on a Zen 4, no change from 4 rows (docs/decisions.md, stop 52) */

/* Columns col0 + s .. col0 + s + nv VW of y for m <= RB rows, from panel p (its [k][64] weights)
 * at column offset s. m and nv are constants where this is inlined: no branches in the loop. */
static inline __attribute__((always_inline)) void panel(int m, int nv, int k, const float *x, const uint16_t *p, int s, const float *b,
                         float *y, int n, int col0) {
    vf acc[RB][PANEL / VW];
    for (int j = 0; j < nv; j++) {
        vf bj = b ? vload(b + s + j * VW) : vzero();
        for (int r = 0; r < RB; r++) acc[r][j] = bj;
    }
    for (int i = 0; i < k; i++) {
        const uint16_t *q = p + (size_t)i * PANEL + s;
        for (int c = 0; c < nv * VW; c += 32)     /* 32 float16 weights: a cache line */
            _mm_prefetch((const char *)(q + PREFETCH * PANEL + c), _MM_HINT_T0);
        if (XFIRST(m, nv)) {              /* the rows' broadcasts held, a weight at a time */
            vf xb[RB];
            for (int r = 0; r < RB; r++) if (r < m) xb[r] = vset(x[(size_t)r * k + i]);
            for (int j = 0; j < nv; j++) {
                vf wj = vhalf(q + j * VW);
                for (int r = 0; r < RB; r++) if (r < m) acc[r][j] = vfma(xb[r], wj, acc[r][j]);
            }
        } else {                          /* the weights held, a row's broadcast at a time */
            vf w[PANEL / VW];
            for (int j = 0; j < nv; j++) w[j] = vhalf(q + j * VW);
            for (int r = 0; r < RB; r++) {
                if (r < m) {
                    vf xv = vset(x[(size_t)r * k + i]);
                    for (int j = 0; j < nv; j++) acc[r][j] = vfma(xv, w[j], acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < nv; j++) {
            int c = col0 + s + j * VW;
            float *out = y + (size_t)r * n + c;
            if (c + VW <= n) vstore(out, acc[r][j]);
            else if (c < n) vstore_m(out, vfirst(n - c), acc[r][j]);
        }
}

#define PASS(M) \
    static void pass##M(int k, int n, int c0, int c1, const float *x, const uint16_t *w, const float *b, float *y) { \
        for (int c = c0; c < c1; c += PANEL) \
            for (int s = 0; s < PANEL && c + s < n; s += NV(M) * VW) \
                panel(M, NV(M), k, x, w + (size_t)c * k, s, b ? b + c : NULL, y, n, c); \
    }
PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6)
#if RB > 6
PASS(7) PASS(8)
#endif

/* Output columns c0..c1-1 (c0 a multiple of PANEL) of every row: half_gemm on one thread. */
static void gemm_columns(int m, int k, int n, const float *x, const uint16_t *w, const float *b, float *y,
                         int c0, int c1) {
    static void (*const passes[])(int, int, int, int, const float *, const uint16_t *, const float *, float *) =
        {NULL, pass1, pass2, pass3, pass4, pass5, pass6,
#if RB > 6
         pass7, pass8
#endif
        };
    if (m <= RB) {
        passes[m](k, n, c0, c1, x, w, b, y);
        return;
    }
    for (int c = c0; c < c1; c += PANEL)          /* more rows: a panel read from memory once, then from L2 */
        for (int r = 0; r < m; r += RB) {
            int rows = m - r < RB ? m - r : RB;
            passes[rows](k, n, c, c + PANEL < c1 ? c + PANEL : c1, x + (size_t)r * k, w, b, y + (size_t)r * n);
        }
}

/* ---- Threads ------------------------------------------------------------------------------
 * A pool of `set_threads(t)` - 1 workers beside the calling thread (pipeline/model/native.py sets
 * t to torch's thread count). `parallel(fn, ctx, items)` runs fn(ctx, i) for i < items on the
 * caller and the workers, each taking the next item from a shared counter, and returns when
 * every worker has finished with the job. half_gemm splits its output panels this way, `attend`
 * its (row, kv head) pairs and a layer's row-wise parts their rows; each item computes what one
 * thread would, in the same order, so results do not depend on the thread count. Workers spin SPIN_NS after a job (a
 * step's Python work between C calls is ~0.1-0.3 ms at batch 1), then sleep until the next.
 * A forked child has no workers (its calls run on one thread), a job asked for from within a
 * job or while another thread's runs is run by its caller alone. */
#define MAX_WORKERS 63
static long SPIN_NS = 2000000L;

typedef void (*item_fn)(void *ctx, int item);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;                  /* bumped for each job */
    atomic_int next;                  /* the job's next item */
    atomic_int checked_in;            /* workers finished with the job */
    atomic_int sleepers;
    atomic_flag busy;                 /* a job is running */
    item_fn fn;
    void *ctx;
    int items, active, started;       /* active: workers taking items; started: workers created */
    pthread_t tid[MAX_WORKERS];
    unsigned born[MAX_WORKERS];       /* the job count when each worker was made: later ones are its */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, ATOMIC_FLAG_INIT, NULL, NULL, 0, 0, 0, {0}, {0}};

static _Thread_local int in_job = 0;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    unsigned seen = pool.born[me];    /* not gen now: a job may have started before this thread ran */
    in_job = 1;                       /* a worker's own calls never start jobs */
    for (;;) {
        unsigned g = atomic_load_explicit(&pool.gen, memory_order_acquire);
        if (g == seen) {
            long until = now_ns() + SPIN_NS;
            for (int spins = 0; (g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen; spins++) {
                _mm_pause();
                if ((spins & 1023) == 1023 && now_ns() > until) {
                    pthread_mutex_lock(&pool.mu);
                    atomic_fetch_add(&pool.sleepers, 1);
                    while ((g = atomic_load(&pool.gen)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                    atomic_fetch_sub(&pool.sleepers, 1);
                    pthread_mutex_unlock(&pool.mu);
                    break;
                }
            }
        }
        seen = g;
        if (me < pool.active)
            for (int i; (i = atomic_fetch_add(&pool.next, 1)) < pool.items;) pool.fn(pool.ctx, i);
        atomic_fetch_add_explicit(&pool.checked_in, 1, memory_order_release);
    }
    return NULL;
}

static void forked_child(void) {      /* the child has none of the parent's workers */
    pool.started = pool.active = 0;
    atomic_flag_clear(&pool.busy);
}

/* Threads for later calls: the caller and t - 1 workers (created on first need, kept). Returns
 * the threads now in use. Call it between jobs (native.cpu_threads does, around the engine's work). */
int set_threads(int t) {
    static int registered = 0;
    int want = t < 1 ? 0 : (t - 1 > MAX_WORKERS ? MAX_WORKERS : t - 1);
    if (atomic_flag_test_and_set(&pool.busy)) return pool.active + 1;
    if (!registered) {
        const char *e = getenv("SPECBATCH_SPIN_NS");
        if (e) SPIN_NS = atol(e);
        pthread_atfork(NULL, NULL, forked_child);
        registered = 1;
    }
    while (pool.started < want) {
        pool.born[pool.started] = atomic_load(&pool.gen);
        if (pthread_create(&pool.tid[pool.started], NULL, worker, (void *)(intptr_t)pool.started)) break;
        pthread_detach(pool.tid[pool.started]);
        pool.started++;
    }
    pool.active = want < pool.started ? want : pool.started;
    atomic_flag_clear(&pool.busy);
    return pool.active + 1;
}

static void parallel(item_fn fn, void *ctx, int items) {
    if (pool.active == 0 || items <= 1 || in_job || atomic_flag_test_and_set(&pool.busy)) {
        for (int i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.items = items;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.checked_in, 0);
    atomic_fetch_add(&pool.gen, 1);                  /* publishes the job (sequentially consistent) */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    in_job = 1;
    for (int i; (i = atomic_fetch_add(&pool.next, 1)) < items;) fn(ctx, i);
    in_job = 0;
    for (int spins = 1; atomic_load_explicit(&pool.checked_in, memory_order_acquire) < pool.started; spins++) {
        _mm_pause();
        if ((spins & 4095) == 0) sched_yield();      /* a worker without a core of its own gets one */
    }
    atomic_flag_clear(&pool.busy);
}

/* Items to split `units` (panels, rows) into: as many as `by_work` (the items of at least a
 * job's minimum work), at most one a unit and 4 a thread, at least 1. */
static int pool_items(long units, long by_work) {
    long most = 4L * (pool.active + 1);
    if (units < most) most = units;
    if (by_work < most) most = by_work;
    return most > 1 ? (int)most : 1;
}

/* ---- half_gemm ------------------------------------------------------------------------------ */
typedef struct {
    int m, k, n, panels, items;
    const float *x, *b;
    const uint16_t *w;
    float *y;
} GemmJob;

static void gemm_item(void *ctx, int item) {
    const GemmJob *j = ctx;
    int p0 = (int)((long)j->panels * item / j->items), p1 = (int)((long)j->panels * (item + 1) / j->items);
    int c1 = p1 * PANEL < j->n ? p1 * PANEL : j->n;
    gemm_columns(j->m, j->k, j->n, j->x, j->w, j->b, j->y, p0 * PANEL, c1);
}

#define GEMM_ITEM_WORK 32768L     /* multiply-adds an item at least (a few us): smaller jobs run on one thread */

/* x: [m, k] float32; w: [ceil(n / 64)][k][64] float16 bits, zero past n; b: NULL or
 * ceil(n / 64) * 64 floats; y: [m, n] float32. Output panels are split over the pool's threads
 * (a panel's columns come out the same on any thread). */
void half_gemm(int m, int k, int n, const float *x, const uint16_t *w, const float *b, float *y) {
    int panels = (n + PANEL - 1) / PANEL;
    long work = (long)m * k * PANEL;                 /* multiply-adds a panel */
    int items = pool_items(panels, work * panels / GEMM_ITEM_WORK);
    if (pool.active == 0 || items <= 1) {
        gemm_columns(m, k, n, x, w, b, y, 0, n);
        return;
    }
    GemmJob job = {m, k, n, panels, items, x, b, w, y};
    parallel(gemm_item, &job, items);
}

/* Rows per pass over a weight (pipeline/model/native.py ROWS): up to this many cost one read. */
int half_gemm_rows(void) { return RB; }

/* RMSNorm of a few rows, y = w * (x * 1 / sqrt(mean(x^2) + eps)) per row of dim floats: one C call
 * where torch's float32 rms_norm is ~10 small ops (~20 us a call at batch 1, 25 calls a demo
 * forward). The sum of squares in another order than torch's; the scaling as transformers'. */
void rms_norm(int rows, int dim, const float *x, const float *w, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        vf acc = vzero();
        int i = 0;
        for (; i + VW <= dim; i += VW) {
            vf v = vload(xr + i);
            acc = vfma(v, v, acc);
        }
        float ss = vsum(acc);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        vf inv = vset(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(ss / (float)dim + eps))));
        for (i = 0; i < dim; i += VW) {
            vm m = vfirst(dim - i);
            vf v = vload_m(m, xr + i);
            vstore_m(yr + i, m, vmul(vload_m(m, w + i), vmul(v, inv)));
        }
    }
}

/* RoPE of one head vector, as pipeline.model.layers.apply_rope: y = x * cos + roll(x, d/2) * sin
 * with sin folded (its first half negated). Two products and a sum, each rounded as torch's
 * three ops round them (the build passes -ffp-contract=off): the same bits. */
static inline void rope(int d, const float *x, const float *c, const float *s, float *y) {
    int half = d / 2;
    for (int j = 0; j < half; j++) y[j] = x[j] * c[j] + x[j + half] * s[j];
    for (int j = half; j < d; j++) y[j] = x[j] * c[j] + x[j - half] * s[j];
}

/* e^x for x in [-87, 0], VW lanes: Cephes' expf (n = round(x / ln 2), x - n ln 2 in two
 * parts, a degree-5 polynomial, times 2^n); within 2 ulp of expf. */
static inline vf vexp(vf x) {
    vf n = vround(vmul(x, vset(1.44269504088896341f)));
    vf r = vfnma(n, vset(0.693359375f), x);
    r = vfnma(n, vset(-2.12194440e-4f), r);
    vf p = vset(1.9875691500e-4f);
    p = vfma(p, r, vset(1.3981999507e-3f));
    p = vfma(p, r, vset(8.3334519073e-3f));
    p = vfma(p, r, vset(4.1665795894e-2f));
    p = vfma(p, r, vset(1.6666665459e-1f));
    p = vfma(p, r, vset(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
    return vscale2(p, n);
}

/* silu(g) = g / (1 + e^-g), VW lanes, from t = e^-|g| (in vexp's range): g / (1 + t) for g >= 0,
 * g t / (1 + t) below, the same quotient without an e^x that overflows */
static inline vf vsilu(vf g) {
    vf t = vexp(vmax(vsub(vzero(), vmax(g, vsub(vzero(), g))), vset(-87.0f)));
    return vdiv(vsel(vlt(g, vzero()), vmul(g, t), g), vadd(vset(1.0f), t));
}

#define QB 4              /* query vectors sharing each load of a key or value vector */

/* out[b][u:u+VW] = sum_j w[b][j] * v[j][u:u+VW] over `keys` keys, for nb <= QB weight rows
 * (row stride ws); m: the lanes of d at u */
static inline void pv_block(int nb, int keys, int d, int u, vm m, const float *w, int ws,
                            const float *v, float *out) {
    vf acc[QB], odd[QB];                 /* even and odd keys: two chains of FMAs per row */
    for (int b = 0; b < QB; b++) acc[b] = odd[b] = vzero();
    int j = 0;
    for (; j + 1 < keys; j += 2) {
        vf x = vload_m(m, v + (size_t)j * d + u), y = vload_m(m, v + (size_t)(j + 1) * d + u);
        for (int b = 0; b < QB; b++)
            if (b < nb) {
                acc[b] = vfma(vset(w[b * ws + j]), x, acc[b]);
                odd[b] = vfma(vset(w[b * ws + j + 1]), y, odd[b]);
            }
    }
    if (j < keys) {
        vf x = vload_m(m, v + (size_t)j * d + u);
        for (int b = 0; b < QB; b++)
            if (b < nb) acc[b] = vfma(vset(w[b * ws + j]), x, acc[b]);
    }
    for (int b = 0; b < nb; b++) vstore_m(out + (size_t)b * d + u, m, vadd(acc[b], odd[b]));
}

/* Ask for rows [from, to) of a [*, d] float32 array to be brought into L2. Attention
 * reads a step's KV cache once, from memory (a 48-row step at 128 keys reads 80 MB on the demo
 * model), one (row, kv head) block at a time with compute between the blocks, and the hardware
 * prefetcher starts afresh at each block: fetching the next block while this one computes made
 * a 48-row step 1.2-1.4x faster on a Zen 4 (docs/decisions.md, stop 52). */
static inline void prefetch_rows(const float *a, int64_t from, int64_t to, int d) {
    const char *p = (const char *)(a + (size_t)from * d), *end = (const char *)(a + (size_t)to * d);
    for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
}

/* the first key a query at position p sees (window > 0: a sliding window of that many keys) */
static inline int64_t first_key(int64_t p, int window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* of a row's `keys` keys from position `first`, how many a query at position p may see: those up
 * to p (a prefill's queries see a growing prefix; computing past it was half their attention) */
static inline int upto(int keys, int64_t first, int64_t p) {
    int64_t k = p - first + 1;
    return k < 0 ? 0 : k > keys ? keys : (int)k;
}

/* the keys row i's queries see: [first, last] */
static inline void row_span(int q, const int64_t *pos, int window, int64_t *first, int64_t *last) {
    *first = INT64_MAX, *last = 0;
    for (int t = 0; t < q; t++) {
        int64_t p = pos[t], lo = first_key(p, window);
        *first = lo < *first ? lo : *first;
        *last = p > *last ? p : *last;
    }
}

/* q . K[k] for the keys k < in of a block (K: key rows, stride d), in lane k: VW independent
 * sums (a key's lanes summed by vtsum), so no keys need gathering; lanes from `in` on repeat the
 * last key (read, never used) */
static inline vf qk_rows(int d, int in, const float *q, const float *K) {
    const float *kr[VW];
    vf part[VW];
    for (int k = 0; k < VW; k++) {
        kr[k] = K + (size_t)(k < in ? k : in - 1) * d;
        part[k] = vzero();
    }
    int u = 0;
    for (; u + VW <= d; u += VW) {
        vf qv = vload(q + u);
        for (int k = 0; k < VW; k++) part[k] = vfma(qv, vload(kr[k] + u), part[k]);
    }
    if (u < d) {
        vm m = vfirst(d - u);
        vf qv = vload_m(m, q + u);
        for (int k = 0; k < VW; k++) part[k] = vfma(qv, vload_m(m, kr[k] + u), part[k]);
    }
    return vtsum(part);
}

#define BLOCKS(NB) \
    static void pv##NB(int keys, int d, int u, vm m, const float *w, int ws, const float *v, float *out) \
        { pv_block(NB, keys, d, u, m, w, ws, v, out); }
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4)
static void (*const PV[QB + 1])(int, int, int, vm, const float *, int, const float *, float *) =
    {NULL, pv1, pv2, pv3, pv4};

typedef struct {
    int n, q, hq, hk, d, cap, vstride, window, width;
    float scale;
    const float *qkv, *cos, *sin;
    const int64_t *rows, *pos;
    const float *kc, *vc;
    const uint8_t *valid;
    float *out;
    atomic_int failed;
} AttendJob;

static _Thread_local float *attend_buf = NULL;    /* a thread's scores and rotated queries */
static _Thread_local size_t attend_cap = 0;

/* One (row i, kv head g) of `attend`: its group's queries over the row's keys. */
static void attend_item(void *ctx, int item) {
    AttendJob *J = ctx;
    int n = J->n, q = J->q, hq = J->hq, hk = J->hk, d = J->d, cap = J->cap, window = J->window, width = J->width;
    int heads = hq + 2 * hk, group = hq / hk, nq = q * group, i = item / hk, g = item % hk;
    const float *qkv = J->qkv, *cos = J->cos, *sin = J->sin, *kc = J->kc, *vc = J->vc;
    const int64_t *rows = J->rows, *pos = J->pos;
    float scale = J->scale, *out = J->out;
    size_t need = (size_t)nq * d + (size_t)nq * width;
    if (need > attend_cap) {
        free(attend_buf);
        attend_buf = malloc(sizeof(float) * need);
        attend_cap = attend_buf ? need : 0;
        if (!attend_buf) {
            atomic_store(&J->failed, 1);
            return;
        }
    }
    float *qs = attend_buf, *w = qs + (size_t)nq * d;
    int64_t lo[nq], hi[nq];
    const vi lane = ilane();
    size_t r = rows ? (size_t)rows[i] : (size_t)i;
    const uint8_t *ok = J->valid ? J->valid + (size_t)i * J->vstride : NULL;
    int64_t first, last;
    row_span(q, pos + (size_t)i * q, window, &first, &last);
    int keys = (int)(last - first + 1), blocks = (keys + VW - 1) / VW;
    for (int t = 0; t < q; t++) {           /* query b = t * group + hh: head g * group + hh */
        const float *src = qkv + ((size_t)i * q + t) * heads * d;
        const float *c = cos + ((size_t)i * q + t) * d, *s = sin + ((size_t)i * q + t) * d;
        int64_t p = pos[(size_t)i * q + t];
        for (int hh = 0; hh < group; hh++) {
            int b = t * group + hh;
            rope(d, src + (size_t)(g * group + hh) * d, c, s, qs + (size_t)b * d);
            hi[b] = p;
            lo[b] = first_key(p, window);
        }
    }
    const float *K = kc + (r * hk + g) * cap * d, *V = vc + (r * hk + g) * cap * d;
    /* the next (row, kv head)'s keys and values, a slice per block of this one's (prefetch_rows) */
    const float *NK = NULL, *NV = NULL;
    int64_t nfirst = first, nlast = last;
    if (g + 1 < hk) {
        NK = K + (size_t)cap * d, NV = V + (size_t)cap * d;
    } else if (i + 1 < n) {
        size_t nr = rows ? (size_t)rows[i + 1] : (size_t)i + 1;
        NK = kc + nr * hk * cap * d, NV = vc + nr * hk * cap * d;
        row_span(q, pos + (size_t)(i + 1) * q, window, &nfirst, &nlast);
    }
    int64_t slice = (nlast - nfirst + blocks) / blocks;
    for (int j0 = 0; j0 < keys; j0 += VW) {      /* VW keys at a time */
        int in = keys - j0 < VW ? keys - j0 : VW;
        vm km = vfirst(in);
        vi jv = iadd(lane, iset((int)(first + j0)));
        vm seen = ok ? vbytes(ok + first + j0, in) : km;
        if (NK) {
            int64_t from = nfirst + j0 / VW * slice, to = from + slice > nlast + 1 ? nlast + 1 : from + slice;
            prefetch_rows(NK, from, to, d);
            prefetch_rows(NV, from, to, d);
        }
        for (int b = 0; b < nq; b++) {
            if (first + j0 > hi[b]) {              /* keys past the query: none visible */
                vstore(w + (size_t)b * width + j0, vset(-INFINITY));
                continue;
            }
            vf sc = qk_rows(d, in, qs + (size_t)b * d, K + (size_t)(first + j0) * d);
            vi ph = iset((int)hi[b]);
            vm m = vm_and(vm_and(vm_or(seen, ieq(jv, ph)), ile(jv, ph)), vm_and(ige(jv, iset((int)lo[b])), km));
            vstore(w + (size_t)b * width + j0, vsel(m, vmul(sc, vset(scale)), vset(-INFINITY)));
        }
    }
    for (int b = 0; b < nq; b++) {                 /* softmax of each query's scores */
        float *wb = w + (size_t)b * width;
        int kb = upto(keys, first, hi[b]);
        vf mx = vset(-INFINITY);
        for (int j0 = 0; j0 < kb; j0 += VW)
            mx = vsel(vfirst(kb - j0), vmax(mx, vload(wb + j0)), mx);
        vf m = vset(vhmax(mx)), sum = vzero();
        for (int j0 = 0; j0 < kb; j0 += VW) {
            vf x = vload(wb + j0);
            vm live = vm_and(vneq(x, vset(-INFINITY)), vfirst(kb - j0));
            vf e = vsel(live, vexp(vmax(vsub(x, m), vset(-87.0f))), vzero());
            vstore(wb + j0, e);
            sum = vadd(sum, e);
        }
        float inv = 1.0f / vsum(sum);
        for (int j0 = 0; j0 < kb; j0 += VW)
            vstore(wb + j0, vmul(vload(wb + j0), vset(inv)));
        for (int j0 = (kb + VW - 1) / VW * VW; j0 < keys; j0 += VW)
            vstore(wb + j0, vzero());             /* past the query: weight 0 where a block reads it */
    }
    const float *Vf = V + (size_t)first * d;
    for (int b0 = 0; b0 < nq; b0 += QB) {          /* the weighted sums of values */
        int nb = nq - b0 < QB ? nq - b0 : QB, kb = 0;
        for (int b = b0; b < b0 + nb; b++) {       /* the keys the block's queries see */
            int u = upto(keys, first, hi[b]);
            kb = u > kb ? u : kb;
        }
        float tmp[QB * d];
        for (int u = 0; u < d; u += VW)
            PV[nb](kb, d, u, vfirst(d - u), w + (size_t)b0 * width, width, Vf, tmp);
        for (int b = 0; b < nb; b++) {
            int t = (b0 + b) / group, hh = (b0 + b) % group;
            memcpy(out + (((size_t)i * q + t) * hq + g * group + hh) * d, tmp + (size_t)b * d, sizeof(float) * d);
        }
    }
}

/* One attention layer of a step over a per-row KV cache (pipeline/model/cache.py), for a few
 * query tokens per row: RoPE on q and k, k and v written into the cache at their positions,
 * then each query at position p attends keys j <= p (j > p - window where window > 0) that
 * `valid` allows or that are p itself: softmax(q.k * scale) v, in float32.
 *
 * Why: at batch 1 torch spends ~15 small ops a layer here (index_put writes, RoPE, the mask,
 * SDPA's setup) against a few us of arithmetic.
 * How: per row and kv head, the queries of its q tokens and its group of query heads each score
 * a block of VW keys at once (`qk_rows`), share each value vector read, and the next row and kv
 * head's keys and values are fetched meanwhile (prefetch_rows); scores, softmax and the weighted sum
 * of values run VW lanes wide, and skip the key blocks past each query (a prefill's queries see a
 * growing prefix: pipeline/model/target.py runs one in pieces through decoder_stack).
 *
 * qkv: [n, q, hq + 2 hk, d] (q heads, k heads, v heads); cos, sin: [n, q, d];
 * rows: [n] cache rows (NULL: row i); pos: [n, q]; kc, vc: the layer's [B, hk, cap, d];
 * valid: NULL or bytes [n, vstride] by key position; out: [n, q, hq, d]. Returns 0, or -1 where
 * it could not allocate its scratch. */
int attend(int n, int q, int hq, int hk, int d, int cap, const float *qkv, const float *cos,
           const float *sin, const int64_t *rows, const int64_t *pos, float *kc, float *vc,
           const uint8_t *valid, int vstride, int window, float scale, float *out) {
    int heads = hq + 2 * hk;
    for (int i = 0; i < n; i++) {
        size_t r = rows ? (size_t)rows[i] : (size_t)i;
        for (int t = 0; t < q; t++) {
            const float *src = qkv + ((size_t)i * q + t) * heads * d;
            const float *c = cos + ((size_t)i * q + t) * d, *s = sin + ((size_t)i * q + t) * d;
            size_t p = (size_t)pos[(size_t)i * q + t];
            for (int h = 0; h < hk; h++) {
                size_t at = ((r * hk + h) * cap + p) * d;
                rope(d, src + (size_t)(hq + h) * d, c, s, kc + at);
                for (int j = 0; j < d; j++) vc[at + j] = src[(size_t)(hq + hk + h) * d + j];
            }
        }
    }
    int64_t top = 0;
    for (size_t x = 0; x < (size_t)n * q; x++) top = pos[x] > top ? pos[x] : top;
    AttendJob job = {n, q, hq, hk, d, cap, vstride, window, (int)((top + VW) / VW * VW), scale, qkv, cos, sin,
                     rows, pos, kc, vc, valid, out, 0};
    parallel(attend_item, &job, n * hk);
    return atomic_load(&job.failed) ? -1 : 0;
}

/* A decoder layer's weights as the C layer reads them (pipeline/model/native.py LayerWeights):
 * norms float32, linears packed float16 (half_gemm's panels), biases padded or NULL. */
typedef struct {
    int hidden, hq, hk, d, inter;
    float eps_in, eps_post;
    const float *norm_in, *norm_post;
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_b, *o_b, *gate_up_b, *down_b;
} Layer;

/* A layer's row-wise parts over rows split among the pool's threads (each row as on one thread):
 * the input norm, the attention residual with the second norm, SiLU-and-product, the MLP residual. */
enum { ROW_NORM, ROW_ADD_NORM, ROW_SILU, ROW_ADD };

typedef struct {
    int op, items, h, inter;
    size_t m;
    const Layer *L;
    const float *x;
    float *y, *t, *gu, *act;
} RowJob;

static void row_item(void *ctx, int item) {
    const RowJob *J = ctx;
    size_t r0 = J->m * item / J->items, r1 = J->m * (item + 1) / J->items;
    int h = J->h, inter = J->inter;
    const Layer *L = J->L;
    switch (J->op) {
    case ROW_NORM:
        rms_norm((int)(r1 - r0), h, J->x + r0 * h, L->norm_in, L->eps_in, J->t + r0 * h);
        break;
    case ROW_ADD_NORM:
        for (size_t i = r0 * h; i < r1 * h; i++) J->y[i] = J->x[i] + J->t[i];
        rms_norm((int)(r1 - r0), h, J->y + r0 * h, L->norm_post, L->eps_post, J->t + r0 * h);
        break;
    case ROW_SILU:
        for (size_t r = r0; r < r1; r++) {
            const float *g = J->gu + r * 2 * inter, *u = g + inter;
            float *o = J->act + r * inter;
            for (int j = 0; j < inter; j += VW) {
                vm k = vfirst(inter - j);
                vstore_m(o + j, k, vmul(vsilu(vload_m(k, g + j)), vload_m(k, u + j)));
            }
        }
        break;
    default:
        for (size_t i = r0 * h; i < r1 * h; i++) J->y[i] += J->t[i];
    }
}

#define ROWS_PER_ITEM 8     /* rows an item at least: a step's few rows stay on the caller */

static void rows_op(RowJob job) {
    job.items = pool_items((long)job.m, (long)(job.m / ROWS_PER_ITEM));
    parallel(row_item, &job, job.items);
}

/* y = x + attn(norm_in(x)); y += mlp(norm_post(y)) for m = n * q tokens, as DecoderLayer.block with
 * fused q|k|v and gate|up projections: one call where the Python layer makes ~25 (norms, five
 * linears, attention, SiLU-and-product, residuals). silu(g) = g / (1 + e^-g) in float32 (vsilu).
 * scratch: floats for [m, hidden + (hq + 2 hk) d + hq d + 3 inter] (`layer_scratch`).
 * The attention arguments as `attend`'s. Returns 0, or -1 where attention could not allocate. */
int decoder_layer(const Layer *L, int n, int q, const float *x, float *y, const float *cos, const float *sin,
                  const int64_t *rows, const int64_t *pos, float *kc, float *vc, int cap,
                  const uint8_t *valid, int vstride, int window, float scale, float *scratch) {
    size_t m = (size_t)n * q;
    int h = L->hidden, qd = (L->hq + 2 * L->hk) * L->d, ad = L->hq * L->d, inter = L->inter;
    float *t = scratch, *qkv = t + m * h, *a = qkv + m * qd, *gu = a + m * ad, *act = gu + m * 2 * inter;
    rows_op((RowJob){ROW_NORM, 0, h, inter, m, L, x, y, t, gu, act});
    half_gemm((int)m, h, qd, t, L->qkv, L->qkv_b, qkv);
    if (attend(n, q, L->hq, L->hk, L->d, cap, qkv, cos, sin, rows, pos, kc, vc, valid, vstride, window, scale, a))
        return -1;
    half_gemm((int)m, ad, h, a, L->o, L->o_b, t);
    rows_op((RowJob){ROW_ADD_NORM, 0, h, inter, m, L, x, y, t, gu, act});
    half_gemm((int)m, h, 2 * inter, t, L->gate_up, L->gate_up_b, gu);
    rows_op((RowJob){ROW_SILU, 0, h, inter, m, L, x, y, t, gu, act});
    half_gemm((int)m, inter, h, act, L->down, L->down_b, t);
    rows_op((RowJob){ROW_ADD, 0, h, inter, m, L, x, y, t, gu, act});
    return 0;
}

/* A target's decoder layers L[0..nl-1] over x in place (`decoder_layer` each, y = x): the step's
 * forward in one call, where a call per layer cost ~10 us of Python and ctypes each at batch 1
 * (a 12-layer step of ~1.3 ms). kc, vc: the cache's [layers, B, hk, cap, d], layer l at l *
 * lstride floats; window, scale: per layer; the other arguments as `decoder_layer`'s. Returns
 * 0, or -1 where attention could not allocate. */
int decoder_stack(const Layer *const *L, int nl, int n, int q, float *x, const float *cos, const float *sin,
                  const int64_t *rows, const int64_t *pos, float *kc, float *vc, size_t lstride, int cap,
                  const uint8_t *valid, int vstride, const int *window, const float *scale, float *scratch) {
    for (int l = 0; l < nl; l++)
        if (decoder_layer(L[l], n, q, x, x, cos, sin, rows, pos, kc + (size_t)l * lstride, vc + (size_t)l * lstride,
                          cap, valid, vstride, window[l], scale[l], scratch))
            return -1;
    return 0;
}

static void rope_rows(size_t m, int d, const int64_t *pos, const float *cos_t, const float *sin_t, float *cs,
                      float *sn);

/* A target's cached forward in one call (TargetModel.forward): the embedding rows of tokens ids
 * [n, q] (table [V, hidden] float32), the rotary rows of their positions (tables cos_t, sin_t by
 * position, sin folded), `decoder_stack`, then the final norm (weight nw, eps neps) into y [n, q,
 * hidden]; nw NULL: y holds the last layer's output, unnormed. Gathers and norm are the torch
 * path's values (copies, and `rms_norm`): the same bits, where Python spent ~10 small torch ops a
 * step around the stack. The other arguments as decoder_stack's; scratch: floats for n q (hidden
 * + 2 d) and decoder_stack's. */
int target_forward(const Layer *const *L, int nl, int n, int q, int hd, const int64_t *ids, const float *table,
                   const float *cos_t, const float *sin_t, const float *nw, float neps, const int64_t *rows,
                   const int64_t *pos, float *kc, float *vc, size_t lstride, int cap, const uint8_t *valid,
                   int vstride, const int *window, const float *scale, float *y, float *scratch) {
    size_t m = (size_t)n * q;
    int d = L[0]->d;
    float *x = nw ? scratch : y, *cs = scratch + m * hd, *sn = cs + m * d, *rest = sn + m * d;
    for (size_t t = 0; t < m; t++) memcpy(x + t * hd, table + (size_t)ids[t] * hd, sizeof(float) * hd);
    rope_rows(m, d, pos, cos_t, sin_t, cs, sn);
    if (decoder_stack(L, nl, n, q, x, cs, sn, rows, pos, kc, vc, lstride, cap, valid, vstride, window, scale, rest))
        return -1;
    if (nw) rms_norm((int)m, hd, x, nw, neps, y);
    return 0;
}

/* An MTP head's input projection (pipeline/model/mtp.py): x = eh_proj([enorm(embed(t)), hnorm(h)]). */
typedef struct {
    int hidden;
    float eps_e, eps_h;
    const float *table, *enorm, *hnorm;     /* table: the token embedding [V, hidden] float32 */
    const uint16_t *eh;
    const float *eh_b;
} MtpInput;

/* An MTP head's forward, MTPHead.forward in one call: the input projection of tokens `ids` [n, q]
 * and previous hidden states prev [n, q, hidden], then its decoder layer (`decoder_layer`, whose
 * other arguments these are) into y [n, q, hidden]. scratch: floats for [m, 3 hidden] and the
 * layer's. */
int mtp_forward(const MtpInput *M, const Layer *L, int n, int q, const int64_t *ids, const float *prev, float *y,
                const float *cos, const float *sin, const int64_t *rows, const int64_t *pos, float *kc, float *vc,
                int cap, const uint8_t *valid, int vstride, int window, float scale, float *scratch) {
    size_t m = (size_t)n * q;
    int h = M->hidden;
    float *cat = scratch, *x = cat + m * 2 * h, *rest = x + m * h;
    for (size_t r = 0; r < m; r++) {
        rms_norm(1, h, M->table + (size_t)ids[r] * h, M->enorm, M->eps_e, cat + r * 2 * h);
        rms_norm(1, h, prev + r * h, M->hnorm, M->eps_h, cat + r * 2 * h + h);
    }
    half_gemm((int)m, 2 * h, h, cat, M->eh, M->eh_b, x);
    return decoder_layer(L, n, q, x, y, cos, sin, rows, pos, kc, vc, cap, valid, vstride, window, scale, rest);
}

/* The rotary rows of m positions: cs, sn [m, d] from tables cos_t, sin_t [> max position, d]. */
static void rope_rows(size_t m, int d, const int64_t *pos, const float *cos_t, const float *sin_t, float *cs,
                      float *sn) {
    for (size_t t = 0; t < m; t++) {
        memcpy(cs + t * d, cos_t + (size_t)pos[t] * d, sizeof(float) * d);
        memcpy(sn + t * d, sin_t + (size_t)pos[t] * d, sizeof(float) * d);
    }
}

/* One head's fill of a step's accepted tokens (Drafter._fill for one head and rows 0..r-1 of its
 * cache): row i's w entries at positions start[i] + 0..w-1, the first count[i] (>= 1) of them
 * real. Marks them in the head's key mask (valid [r, vstride]: real 1, padding 0, the torch
 * path's scatter), runs `mtp_forward` over ids, hidden [r, w, hidden] with that mask and the
 * rotary rows of the positions (tables cos_t, sin_t by position), and copies each row's output
 * at its last real entry into carry [r, hidden]. One call where the torch path takes ~20 small
 * ops. scratch: floats for r w (2 d + hidden) and mtp_forward's for r w tokens.
 * Returns 0, or -1 where memory runs out. */
int mtp_fill(const MtpInput *M, const Layer *L, int r, int w, const int64_t *start, const int64_t *count,
             const int64_t *ids, const float *hidden, const float *cos_t, const float *sin_t, float *kc, float *vc,
             int cap, uint8_t *valid, int vstride, int window, float scale, float *carry, float *scratch) {
    int hd = M->hidden, d = L->d;
    size_t m = (size_t)r * w;
    float *cs = scratch, *sn = cs + m * d, *y = sn + m * d, *rest = y + m * hd;
    int64_t *pos = malloc(m * sizeof(int64_t));
    if (!pos) return -1;
    for (int i = 0; i < r; i++)
        for (int j = 0; j < w; j++) {
            size_t t = (size_t)i * w + j;
            pos[t] = start[i] + j;
            valid[(size_t)i * vstride + pos[t]] = j < count[i];
        }
    rope_rows(m, d, pos, cos_t, sin_t, cs, sn);
    int status = mtp_forward(M, L, r, w, ids, hidden, y, cs, sn, NULL, pos, kc, vc, cap, valid, vstride, window,
                             scale, rest);
    if (!status)
        for (int i = 0; i < r; i++)
            memcpy(carry + (size_t)i * hd, y + ((size_t)i * w + count[i] - 1) * hd, sizeof(float) * hd);
    free(pos);
    return status;
}

static int64_t coupled_pick(int v, float *x, const int64_t *ids, float temperature, uint64_t word, int64_t key,
                            int64_t position);
static int64_t argmax_row(int v, const float *x);

/* Greedy drafts of one MTP head at depths first..last (pipeline/engine/drafter.py): at depth j >= 2
 * the head's forward on (h, the draft of depth j - 1) at position lengths + j - 2, then at every
 * depth the draft = argmax over the output linear (its draft vocabulary `ids`, or all rows) of
 * norm(h): one call for a step's depths where Python makes ~20 calls a depth.
 * h [n, hidden]: the hidden state to draft from (depth `first`), left at depth `last`'s.
 * tokens: int64 with row stride tstride, pointing at depth `first`'s column (the column before
 * holds depth first - 1's draft where first >= 2). cos_t, sin_t: rotary tables [> max position, d]
 * (sin folded). valid: the head's filled keys [n, vstride] (NULL: none); a row's keys
 * lengths + lo_off .. lengths + hi_off (this step's drafts) are visible besides (the mask
 * Drafter._visible builds in torch, built here: ~7 torch ops a step at batch 1).
 * scratch: floats for n * (2 d + 2 hidden + vout) and mtp_forward's for n tokens.
 * The argmax is the first index of the largest value (torch.argmax's, NaN aside).
 * keys (row keys [n], or NULL): coupled sampling's pick instead (`coupled_pick`: `temperature`,
 * `word` as exp_noise takes it; depth j's draft lands at position lengths + j).
 * Returns 0, or -1 where memory for the mask or attention's scratch runs out. */
int mtp_greedy(const MtpInput *M, const Layer *L, const float *nw, float neps, const uint16_t *out_w,
               const float *out_b, int vout, const int64_t *ids, int n, int first, int last, float *h,
               const int64_t *lengths, const float *cos_t, const float *sin_t, float *kc, float *vc, int cap,
               const uint8_t *valid, int vstride, int lo_off, int hi_off, int window, float scale,
               int64_t *tokens, int tstride, float *scratch, float temperature, uint64_t word,
               const int64_t *keys) {
    int hd = M->hidden, d = L->d;
    float *cs = scratch, *sn = cs + (size_t)n * d, *y = sn + (size_t)n * d, *nx = y + (size_t)n * hd;
    float *lg = nx + (size_t)n * hd, *rest = lg + (size_t)n * vout;
    int64_t pos[n], prev[n];
    uint8_t *vis = NULL;
    int vw = 0;
    if (last >= 2) {                       /* keys a depth >= 2 attends: up to lengths + hi_off */
        int64_t most = 0;
        for (int i = 0; i < n; i++) most = lengths[i] > most ? lengths[i] : most;
        vw = (int)(most + hi_off + 1);
        vis = malloc((size_t)n * vw);
        if (!vis) return -1;
        for (int i = 0; i < n; i++) {
            uint8_t *row = vis + (size_t)i * vw;
            int have = valid ? (vw < vstride ? vw : vstride) : 0;
            if (have) memcpy(row, valid + (size_t)i * vstride, (size_t)have);
            memset(row + have, 0, (size_t)(vw - have));
            for (int64_t k = lengths[i] + lo_off; k <= lengths[i] + hi_off; k++) row[k] = 1;
        }
    }
    for (int j = first; j <= last; j++) {
        int col = j - first;
        if (j >= 2) {
            for (int i = 0; i < n; i++) {
                pos[i] = lengths[i] + j - 2;
                prev[i] = tokens[(size_t)i * tstride + col - 1];
            }
            rope_rows(n, d, pos, cos_t, sin_t, cs, sn);
            if (mtp_forward(M, L, n, 1, prev, h, y, cs, sn, NULL, pos, kc, vc, cap, vis, vw, window, scale, rest)) {
                free(vis);
                return -1;
            }
            memcpy(h, y, sizeof(float) * (size_t)n * hd);
        }
        rms_norm(n, hd, h, nw, neps, nx);
        half_gemm(n, hd, vout, nx, out_w, out_b, lg);
        for (int i = 0; i < n; i++) {
            float *r = lg + (size_t)i * vout;
            int64_t best = 0;
            if (keys) {
                best = coupled_pick(vout, r, ids, temperature, word, keys[i], lengths[i] + j);
            } else {
                for (int v = 1; v < vout; v++)
                    if (r[v] > r[best]) best = v;
            }
            tokens[(size_t)i * tstride + col] = ids ? ids[best] : best;
        }
    }
    free(vis);
    return 0;
}

/* The first index of the largest of v floats, or of the first NaN where there is one: torch.argmax's
 * rule. One vector pass takes the largest value, with x * 0 summed alongside (NaN where any value
 * is NaN or infinite); where that flags nothing a scalar pass finds the value's first index, else
 * a scalar pass applies the rule value by value. */
static int64_t argmax_row(int v, const float *x) {
    vf mx = vset(-INFINITY), odd = vzero(), zero = vzero();
    int i = 0;
    for (; i + VW <= v; i += VW) {
        vf t = vload(x + i);
        mx = vmax(mx, t);
        odd = vadd(odd, vmul(t, zero));
    }
    float m = vhmax(mx), flag = vsum(odd);
    for (; i < v; i++) {
        m = x[i] > m ? x[i] : m;
        flag += x[i] * 0.0f;
    }
    if (flag == 0.0f) {                  /* every value finite: the first that equals the largest */
        vf mv = vset(m);
        for (i = 0; i + VW <= v; i += VW) {
            int bits = veq_bits(vload(x + i), mv);
            if (bits) return i + __builtin_ctz((unsigned)bits);
        }
        for (; i < v; i++)
            if (x[i] == m) return i;
    }
    int64_t best = 0;
    for (i = 0; i < v; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

typedef struct {
    int n, v, items;
    const float *x;
    int64_t *out;
} ArgmaxJob;

static void argmax_item(void *ctx, int item) {
    const ArgmaxJob *J = ctx;
    int r0 = (int)((int64_t)J->n * item / J->items), r1 = (int)((int64_t)J->n * (item + 1) / J->items);
    for (int r = r0; r < r1; r++) J->out[r] = argmax_row(J->v, J->x + (size_t)r * J->v);
}

#define ARGMAX_ITEM_VALUES 32768   /* values an item at least: a step's few rows stay on the caller */

/* out[r] = argmax of row r of x [n, v] (argmax_row's rule), rows split across the pool. */
void argmax_rows(int n, int v, const float *x, int64_t *out) {
    int items = pool_items(n, (long)n * v / ARGMAX_ITEM_VALUES);
    ArgmaxJob job = {n, v, items, x, out};
    parallel(argmax_item, &job, items);
}

/* A greedy verify's output in one call (pipeline/engine/verify.py `greedy_verify`): the output
 * linear over the m = n q hidden rows x [m, k] (half_gemm: w packed [v, k], bias b) into scratch
 * logits [m, v], each row's argmax (argmax_rows' rule) into tokens [n, q], and each row's accepted
 * drafts: the length of the prefix of drafts [n, q - 1] equal to its tokens (a -1 pad equals none).
 * Example, q 3: drafts [5, 7], tokens [5, 9, 4] -> accepted 1. */
void greedy_head(int n, int q, int k, int v, const float *x, const uint16_t *w, const float *b,
                 const int64_t *drafts, int64_t *tokens, int64_t *accepted, float *logits) {
    int m = n * q;
    half_gemm(m, k, v, x, w, b, logits);
    argmax_rows(m, v, logits, tokens);
    for (int r = 0; r < n; r++) {
        int a = 0;
        while (a < q - 1 && drafts[(size_t)r * (q - 1) + a] == tokens[(size_t)r * q + a]) a++;
        accepted[r] = a;
    }
}

/* ---- coupled sampling's noise ---------------------------------------------------------------- */
/* pipeline.spec_decode.rng.exponential_noise's values: for row i and token v (tokens[i][j], or
 * j), SplitMix64's finaliser over state base[i] + v * golden, its top 23 bits b, u = (b + 0.5)
 * / 2^23 and E = -log(u). The integers and u are the same bits as torch's; the log is
 * `neg_log` (within one float32 ulp of libm's logf, at most 8.1e-8 relative, over every u this
 * can take), where torch's ~20 passes over [rows, V] int64 cost ~0.3 ms for a single row. Plain
 * C that the compiler vectorises where the CPU multiplies 64-bit lanes (AVX-512DQ). */
#define SPLIT_GOLDEN 0x9E3779B97F4A7C15ULL
#define SPLIT_M1 0xBF58476D1CE4E5B9ULL
#define SPLIT_M2 0x94D049BB133111EBULL

/* -log(x) for a positive normal float x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(1 + f),
 * f = m - 1, by Cephes' logf polynomial, e ln 2 in two parts. */
static inline float neg_log(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    int e = (int)(b >> 23) - 127;
    uint32_t mb = (b & 0x7fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &mb, 4);
    int big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e += big;
    float f = m - 1.0f, z = f * f, p = 7.0376836292E-2f;
    p = p * f - 1.1514610310E-1f;
    p = p * f + 1.1676998740E-1f;
    p = p * f - 1.2420140846E-1f;
    p = p * f + 1.4249322787E-1f;
    p = p * f - 1.6668057665E-1f;
    p = p * f + 2.0000714765E-1f;
    p = p * f - 2.4999993993E-1f;
    p = p * f + 3.3333331174E-1f;
    float fe = (float)e, y = f * z * p;
    y = y + fe * -2.12194440e-4f;
    y = y - 0.5f * z;
    return -((f + y) + fe * 0.693359375f);
}

static inline float split_noise(uint64_t z) {
    z = (z ^ (z >> 30)) * SPLIT_M1;
    z = (z ^ (z >> 27)) * SPLIT_M2;
    z ^= z >> 31;
    return neg_log(((float)(int32_t)(z >> 41) + 0.5f) * (1.0f / 8388608.0f));
}

/* SplitMix64 (state advanced by golden, then the finaliser): rng.splitmix64 */
static inline uint64_t splitmix64(uint64_t z) {
    z += SPLIT_GOLDEN;
    z = (z ^ (z >> 30)) * SPLIT_M1;
    z = (z ^ (z >> 27)) * SPLIT_M2;
    return z ^ (z >> 31);
}

typedef struct {
    int r, m, items;
    uint64_t word;                 /* splitmix64(seed ^ stream word): rng.counter_hash's first step */
    const int64_t *keys, *positions, *tokens;
    float *out;
} NoiseJob;

static void noise_item(void *ctx, int item) {
    const NoiseJob *J = ctx;
    int r0 = (int)((int64_t)J->r * item / J->items), r1 = (int)((int64_t)J->r * (item + 1) / J->items);
    for (int i = r0; i < r1; i++) {               /* rng.noise_states: counter_hash + golden */
        uint64_t base = splitmix64(splitmix64(J->word ^ (uint64_t)J->keys[i]) ^ (uint64_t)J->positions[i]) + SPLIT_GOLDEN;
        float *o = J->out + (size_t)i * J->m;
        if (J->tokens) {
            const int64_t *t = J->tokens + (size_t)i * J->m;
            for (int j = 0; j < J->m; j++) o[j] = split_noise(base + (uint64_t)t[j] * SPLIT_GOLDEN);
        } else {
            for (int j = 0; j < J->m; j++) o[j] = split_noise(base + (uint64_t)j * SPLIT_GOLDEN);
        }
    }
}

#define NOISE_ITEM_VALUES 32768    /* values an item at least, as argmax_rows */

/* out[i, j] = E of token j (tokens: [r, m] ids, or NULL for 0..m-1) at the position of row key
 * keys[i] and position positions[i]; `word`: splitmix64(seed ^ stream word), as rng.counter_hash
 * starts. Rows split across the pool. */
void exp_noise(int r, int m, uint64_t word, const int64_t *keys, const int64_t *positions,
               const int64_t *tokens, float *out) {
    int items = pool_items(r, (long)r * m / NOISE_ITEM_VALUES);
    NoiseJob job = {r, m, items, word, keys, positions, tokens, out};
    parallel(noise_item, &job, items);
}

/* Coupled sampling's pick from logits x [v] (overwritten) at temperature t > 0: the index k of
 * the largest e^(x_k / t - max) / E(token ids[k], or k) with E the position's exp_noise value,
 * i.e. argmax p_k / E_k, what pipeline.spec_decode.sampling.coupled_sample picks from softmax(x / t)
 * over the same noise (a draft vocabulary's tokens keyed by their ids, as its full-vocabulary
 * logits with -inf elsewhere). For a draft: e^x and the division round apart from torch's
 * softmax, which can change a pick only where two tokens tie to float32 precision. */
static int64_t coupled_pick(int v, float *x, const int64_t *ids, float temperature, uint64_t word, int64_t key,
                            int64_t position) {
    float inv = 1.0f / temperature, mx = -INFINITY;
    for (int k = 0; k < v; k++) {
        x[k] *= inv;
        mx = x[k] > mx ? x[k] : mx;
    }
    int k = 0;
    for (; k + VW <= v; k += VW)
        vstore(x + k, vexp(vmax(vsub(vload(x + k), vset(mx)), vset(-87.0f))));
    for (; k < v; k++) {
        float e = x[k] - mx;
        x[k] = expf(e > -87.0f ? e : -87.0f);
    }
    uint64_t base = splitmix64(splitmix64(word ^ (uint64_t)key) ^ (uint64_t)position) + SPLIT_GOLDEN;
    for (k = 0; k < v; k++)
        x[k] /= split_noise(base + (uint64_t)(ids ? ids[k] : k) * SPLIT_GOLDEN);
    return argmax_row(v, x);
}
