/* The host kernels' thread pool (kernels/host_gemv.py builds it into one library with host/codebook_host.c).

   tp_pool_run(fn, arg, N, nt): fn(arg, n0, n1) over chunks of the rows 0 .. N - 1 on the caller and up to nt - 1
   workers; returns when every chunk is done. Which thread runs a chunk is not fixed (see below): callers whose
   every output row is one fixed sequence get the same bits for every thread count and schedule. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#define TP_X86 1
#else
#define TP_X86 0
#endif

/* A call's output rows are cut into chunks that the caller and up to threads - 1 workers claim from one atomic
   word (generation << 32 | next chunk): a thread that the OS does not schedule claims nothing and is not waited
   for (the caller takes what is left), so a busy machine does not stall every call. Which thread computes a
   chunk does not change a bit of it: every output element is one thread's fixed sequence. Workers spin briefly
   after a call, then sleep. Two chunks a thread (at least 16 rows each): on the development VM's Zen 4 at two
   threads SmolLM2's layer GEMVs ran 1.13x (Qwen's 1.04x) faster than with the eight a thread before session 16,
   fewer claims on the shared word and longer row runs a thread; the head the same (BENCHMARKS.md "Session 16"). */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int n_workers;                 /* workers started: thread ids 1..n_workers */
static atomic_long gen;               /* bumped once per parallel call (wakes the workers) */
static atomic_ullong claim;           /* (generation << 32) | (chunks << 16) | next chunk index */
static atomic_long done_chunks;       /* chunks finished in the current call */
static int sleepers;                  /* under wake_mu */
static void (*cur_fn)(const void *, long, long);
static const void *cur_arg;
static long cur_n;
static int cur_nt;
static long cur_chunk, cur_nchunks;   /* rows per chunk, chunks (at most 2 * threads: fits 16 bits) */
#define MAX_THREADS 256
static long start_gen[MAX_THREADS];   /* the generation a worker was started at (it runs the next one) */

#define SPINS 20000

static inline void relax(void) {
#if TP_X86
  __builtin_ia32_pause();
#endif
}

/* claim and run chunks of generation g until none is left (or the call moved on) */
static void work(unsigned long long g) {
  for (;;) {
    unsigned long long c = atomic_load_explicit(&claim, memory_order_acquire);
    if ((c >> 32) != (g & 0xffffffffull)) return;  /* another call's word */
    long i = (long)(c & 0xffff), nch = (long)((c >> 16) & 0xffff);
    if (i >= nch) return;
    if (!atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
      continue;
    /* chunk i of a live call (it cannot finish before this chunk): its job is the one published with the word */
    long n0 = i * cur_chunk, n1 = n0 + cur_chunk < cur_n ? n0 + cur_chunk : cur_n;
    cur_fn(cur_arg, n0, n1);
    atomic_fetch_add_explicit(&done_chunks, 1, memory_order_release);
  }
}

static void *worker(void *arg) {
  int tid = (int)(intptr_t)arg;
  long seen = start_gen[tid];
  for (;;) {
    long g;
    int spins = 0;
    while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen) {
      if (++spins < SPINS) { relax(); continue; }
      pthread_mutex_lock(&wake_mu);
      sleepers++;
      while (atomic_load(&gen) == seen) pthread_cond_wait(&wake_cv, &wake_mu);
      sleepers--;
      pthread_mutex_unlock(&wake_mu);
    }
    seen = g;
    if (tid < cur_nt) work((unsigned long long)g);  /* a stale cur_nt only meets a claim word of another call */
  }
  return NULL;
}

static void after_fork_child(void) { /* the workers did not survive the fork */
  pthread_mutex_init(&pool_mu, NULL);
  pthread_mutex_init(&wake_mu, NULL);
  pthread_cond_init(&wake_cv, NULL);
  n_workers = 0; sleepers = 0;
}

static int atfork_done;

void tp_pool_run(void (*fn)(const void *, long, long), const void *arg, long N, int nt) {
  if (nt > MAX_THREADS) nt = MAX_THREADS;
  pthread_mutex_lock(&pool_mu);
  if (!atfork_done) { pthread_atfork(NULL, NULL, after_fork_child); atfork_done = 1; }
  while (n_workers < nt - 1) {
    pthread_t th;
    start_gen[n_workers + 1] = atomic_load(&gen);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&th, &at, worker, (void *)(intptr_t)(n_workers + 1)) == 0;
    pthread_attr_destroy(&at);
    if (!ok) break;
    n_workers++;
  }
  unsigned long long g = (unsigned long long)atomic_load(&gen) + 1;
  long chunk = (N + 2L * nt - 1) / (2L * nt);
  if (chunk < 16) chunk = 16;
  cur_fn = fn; cur_arg = arg; cur_n = N; cur_nt = nt; cur_chunk = chunk; cur_nchunks = (N + chunk - 1) / chunk;
  atomic_store_explicit(&done_chunks, 0, memory_order_relaxed);
  /* a stale worker's compare-exchange on the previous word fails from here on */
  atomic_store_explicit(&claim, ((g & 0xffffffffull) << 32) | ((unsigned long long)cur_nchunks << 16),
                        memory_order_release);
  pthread_mutex_lock(&wake_mu);
  atomic_store_explicit(&gen, (long)g, memory_order_release);
  if (sleepers) pthread_cond_broadcast(&wake_cv);
  pthread_mutex_unlock(&wake_mu);
  work(g);
  int spins = 0;
  while (atomic_load_explicit(&done_chunks, memory_order_acquire) < cur_nchunks) {
    if (++spins < SPINS) relax(); else sched_yield();
  }
  pthread_mutex_unlock(&pool_mu);
}

