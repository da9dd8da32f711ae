/* A small persistent pthread pool.  Not OpenMP on purpose: it has to coexist with the OpenMP runtime that torch
 * loads (two OpenMP runtimes in one process fight over threads and can deadlock), and it must be usable from
 * several Python threads at once with the GIL released.
 *
 * Workers spin briefly on a generation counter (a decode step makes one call per layer, microseconds apart), then
 * sleep on a condition variable so an idle library costs no CPU.  The calling thread is participant 0 and works
 * through the job's items like any worker.
 *
 * Tickets: a job offers n_workers tickets; a worker runs the job only after taking one, and the caller revokes the
 * tickets left once its own share is done (the work items are claimed from the job's own counters, so by then all
 * items are claimed).  A worker that is descheduled (an oversubscribed machine: other processes, torch threads)
 * therefore never holds up a call it has not joined; before, the caller waited for every worker to pass by, which
 * cost a scheduler time slice (~0.2 ms and more on a loaded 2-core VM) per call. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include "fx_internal.h"

/* How long an idle worker spins (with a pause instruction) before sleeping: a decode step calls once per layer and
 * kernel, tens to a couple of hundred us apart, and waking 15 sleeping threads through the condition variable
 * costs tens of us, while a spinning worker starts within ~1 us. */
#define FX_SPIN_NS 200000

/* The spin is a setting: between the layers of a GPU decode step the host is idle for the device's share of a layer
 * (0.2-1 ms), longer than FX_SPIN_NS, so without a longer spin every layer's first call woke sleeping workers and
 * ran largely on its caller alone (research/pool_wake.py, VM: a 32K top-k 201 us back to back, 328 us after a 1 ms
 * pause). The GPU step raises it for its duration (fx_pool_set_spin_ns) and wakes the pool ahead of its calls
 * (fx_pool_wake); CPU decoding keeps the short spin so idle workers do not take cores from torch's threads. */
static _Atomic int64_t g_spin_ns = FX_SPIN_NS;

static struct {
    pthread_mutex_t run_lock; /* held by the thread whose job owns the pool */
    pthread_mutex_t mu;       /* guards sleeping on cv */
    pthread_cond_t cv;
    _Atomic uint64_t generation;
    _Atomic int pending;      /* tickets taken and not finished, plus tickets not yet taken */
    _Atomic int tickets;      /* tickets still on offer for the current job */
    _Atomic int stop;
    _Atomic int sleepers;     /* workers inside the condition-variable wait */
    fx_job_fn fn;
    void *ctx;
    int nthreads;             /* participants, caller included */
    int started;              /* worker threads exist */
    pthread_t workers[1024];
    int n_workers;
    int atfork_registered;
    uint64_t start_generation; /* generation before the workers were created */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL, 1, 0,
       {0}, 0, 0, 0};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    sched_yield();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *worker_main(void *arg) {
    int tid = (int)(intptr_t)arg;
    uint64_t seen = P.start_generation; /* not a fresh load: the first job may already have been posted */
    for (;;) {
        int64_t t0 = now_ns(), spin_ns = atomic_load(&g_spin_ns);
        int spins = 0;
        while (atomic_load(&P.generation) == seen && !atomic_load(&P.stop)) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() - t0 > spin_ns) {
                pthread_mutex_lock(&P.mu);
                /* announce first, then re-check (both seq_cst): a poster that reads sleepers == 0 has bumped the
                 * generation before this load, so the check below sees it and no wake-up is lost */
                atomic_fetch_add(&P.sleepers, 1);
                while (atomic_load(&P.generation) == seen && !atomic_load(&P.stop)) pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        if (atomic_load(&P.stop)) return NULL;
        seen = atomic_load(&P.generation);
        int t = atomic_load(&P.tickets);
        while (t > 0 && !atomic_compare_exchange_weak(&P.tickets, &t, t - 1)) {
        }
        if (t <= 0) continue; /* too late: the caller finished without us; fn/ctx may already be gone */
        /* A ticket was on offer, so fn/ctx (written before the offer) belong to a job that is still running. */
        P.fn(P.ctx, tid, P.nthreads);
        atomic_fetch_sub(&P.pending, 1);
    }
}

/* After fork() the child has none of the parent's worker threads: forget them and start afresh on first use. */
static void after_fork_child(void) {
    pthread_mutex_init(&P.run_lock, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    P.started = 0;
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
    atomic_store(&P.pending, 0);
    atomic_store(&P.tickets, 0);
    atomic_store(&P.sleepers, 0);
}

static void stop_workers(void) {
    if (!P.started) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.workers[i], NULL);
    P.n_workers = 0;
    P.started = 0;
    atomic_store(&P.stop, 0);
}

static void start_workers(void) {
    if (!P.atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_child);
        P.atfork_registered = 1;
    }
    P.n_workers = 0;
    P.start_generation = atomic_load(&P.generation);
    for (int i = 1; i < P.nthreads; i++) {
        if (pthread_create(&P.workers[P.n_workers], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        P.n_workers++;
    }
    P.nthreads = P.n_workers + 1; /* if thread creation failed, run with what we have */
    P.started = 1;
}

void fx_pool_run(fx_job_fn fn, void *ctx) {
    if (pthread_mutex_trylock(&P.run_lock) != 0) {
        fn(ctx, 0, 1); /* another thread's job holds the pool: do this one alone rather than wait */
        return;
    }
    if (P.nthreads > 1 && !P.started) start_workers();
    if (P.nthreads <= 1) {
        fn(ctx, 0, 1);
        pthread_mutex_unlock(&P.run_lock);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    atomic_store(&P.pending, P.n_workers);
    atomic_store(&P.tickets, P.n_workers);
    atomic_fetch_add(&P.generation, 1);
    if (atomic_load(&P.sleepers) > 0) { /* spinning workers see the generation; only sleepers need the cv */
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    fn(ctx, 0, P.nthreads);
    /* every item is claimed now: workers that have not joined yet need not (and must not) join */
    int left = atomic_exchange(&P.tickets, 0);
    if (left > 0) atomic_fetch_sub(&P.pending, left);
    int spins = 0;
    while (atomic_load(&P.pending) > 0) {
        if (++spins < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&P.run_lock);
}

int fx_pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > 1024) n = 1024;
    pthread_mutex_lock(&P.run_lock);
    stop_workers();
    P.nthreads = n;
    pthread_mutex_unlock(&P.run_lock);
    return n;
}

int fx_pool_threads(void) { return P.nthreads; }

int64_t fx_pool_set_spin_ns(int64_t ns) {
    if (ns < 0) ns = FX_SPIN_NS; /* negative: back to the default */
    if (ns > 1000000000) ns = 1000000000;
    atomic_store(&g_spin_ns, ns);
    return ns;
}

int64_t fx_pool_spin_ns(void) { return atomic_load(&g_spin_ns); }

/* A new generation with no tickets: sleeping workers wake, find nothing to take and spin again (for the current spin
 * time), so the next call finds them running. Skipped while a job or a resize holds the pool (its workers are
 * awake) and before the workers exist. */
void fx_pool_wake(void) {
    if (!P.started || atomic_load(&P.sleepers) == 0) return;
    if (pthread_mutex_trylock(&P.run_lock) != 0) return;
    if (P.started) {
        atomic_fetch_add(&P.generation, 1);
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    pthread_mutex_unlock(&P.run_lock);
}

void fx_run_task_items(void *job, _Atomic int64_t *next, const int64_t *first, int64_t n_tasks, _Atomic int32_t *done,
                       fx_item_fn item, fx_task_done_fn task_done) {
    int64_t t = 0, total = first[n_tasks];
    for (;;) {
        int64_t i = atomic_fetch_add(next, 1);
        if (i >= total) return;
        while (first[t + 1] <= i) t++;
        item(job, t, i - first[t], i);
        if (atomic_fetch_add(&done[t], 1) == first[t + 1] - first[t] - 1) task_done(job, t);
    }
}
