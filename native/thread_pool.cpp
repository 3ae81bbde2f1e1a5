#include "thread_pool.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EV_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define EV_PAUSE() asm volatile("yield")
#else
#define EV_PAUSE() ((void)0)
#endif

namespace evn {

namespace {
constexpr int kSpinIterations = 20000;  // ~ tens of microseconds before a worker sleeps
constexpr uint64_t kClosed = 1ull << 31;
constexpr uint64_t kCountMask = kClosed - 1;
inline uint64_t gen_of(uint64_t s) { return s >> 32; }
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
    state_.store(kClosed);  // generation 0 is closed: nothing to join until the first region
    threads_.reserve(static_cast<size_t>(n_ - 1));
    for (int i = 1; i < n_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_.store(true);
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
}

void ThreadPool::work(int slot) {
    for (;;) {
        const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
        if (c >= n_chunks_) return;
        fn_(ctx_, c, slot);
        done_chunks_.fetch_add(1, std::memory_order_release);
    }
}

// Names the worker "evk-worker-N" (top -H, perf, gdb) and, when EDGEVLM_PIN_THREADS=1, pins it
// to the N-th CPU the process may run on (the caller, slot 0, stays unpinned: it is the
// application's thread). Off by default: on a shared machine a pinned thread cannot move away
// from a busy core; on a dedicated robot computer it keeps caches warm and avoids migrations.
void ThreadPool::setup_worker(int slot) {
#if defined(__linux__)
    const std::string name = "evk-worker-" + std::to_string(slot);
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    const char* pin = std::getenv("EDGEVLM_PIN_THREADS");
    if (!pin || std::string(pin) != "1") return;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
    const int n_cpus = CPU_COUNT(&allowed);
    if (n_cpus < 1) return;
    int want = slot % n_cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (!CPU_ISSET(cpu, &allowed)) continue;
        if (want-- == 0) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(cpu, &one);
            pthread_setaffinity_np(pthread_self(), sizeof one, &one);
            return;
        }
    }
#else
    (void)slot;
#endif
}

void ThreadPool::worker(int slot) {
    setup_worker(slot);
    uint64_t seen = 0;
    for (;;) {
        uint64_t s = state_.load(std::memory_order_acquire);
        for (int spin = 0; (gen_of(s) == seen || (s & kClosed)) && spin < kSpinIterations; ++spin) {
            EV_PAUSE();
            s = state_.load(std::memory_order_acquire);
        }
        if (gen_of(s) == seen || (s & kClosed)) {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] {
                const uint64_t x = state_.load(std::memory_order_acquire);
                return stop_.load() || (gen_of(x) != seen && !(x & kClosed));
            });
            if (stop_.load()) return;
            s = state_.load(std::memory_order_acquire);
        }
        if (stop_.load()) return;
        seen = gen_of(s);
        // Join the region only while it is open: a late worker must not touch a finished one.
        bool joined = false;
        while (gen_of(s) == seen && !(s & kClosed)) {
            if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) { joined = true; break; }
        }
        if (!joined) continue;
        work(slot);
        state_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::run(int64_t n_chunks, Fn fn, void* ctx) {
    if (n_chunks <= 0) return;
    if (n_ == 1 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; ++c) fn(ctx, c, 0);
        return;
    }
    std::lock_guard<std::mutex> region(run_mu_);
    fn_ = fn;
    ctx_ = ctx;
    n_chunks_ = n_chunks;
    next_chunk_.store(0, std::memory_order_relaxed);
    done_chunks_.store(0, std::memory_order_relaxed);
    {
        // Opening under the mutex means a worker about to sleep cannot miss this region.
        std::lock_guard<std::mutex> lk(mu_);
        const uint64_t g = gen_of(state_.load()) + 1;
        state_.store(g << 32, std::memory_order_release);
    }
    cv_.notify_all();
    work(0);
    // Close the region, then wait for the workers inside it: they hold at most one chunk each.
    state_.fetch_or(kClosed, std::memory_order_acq_rel);
    for (int spin = 0; (state_.load(std::memory_order_acquire) & kCountMask) != 0; ++spin) {
        if (spin < kSpinIterations) EV_PAUSE(); else std::this_thread::yield();
    }
}

}  // namespace evn
