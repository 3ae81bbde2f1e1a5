// A persistent pool. A parallel region is a number of independent chunks; every thread, the
// caller included, claims chunks from an atomic counter until none are left. On a shared 2-core
// machine a worker may be descheduled at any moment: the caller then simply runs the remaining
// chunks itself and waits only for chunks already claimed, never for a sleeping thread.
// Workers spin briefly for the next region (decode issues hundreds per token), then sleep.
// Nothing is allocated per region; results do not depend on which thread ran a chunk.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace evn {

class ThreadPool {
public:
    // fn(ctx, chunk, thread): thread is a stable slot in [0, size()) for per-thread scratch.
    using Fn = void (*)(void* ctx, int64_t chunk, int thread);

    explicit ThreadPool(int n_threads);  // total threads, the caller counted as slot 0
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_; }
    void run(int64_t n_chunks, Fn fn, void* ctx);

    // Runs f(chunk, thread) for every chunk; f is only referenced, never copied or stored.
    template <class F> void run(int64_t n_chunks, F& f) {
        run(n_chunks, [](void* c, int64_t chunk, int t) { (*static_cast<F*>(c))(chunk, t); }, &f);
    }

private:
    void worker(int slot);
    static void setup_worker(int slot);
    void work(int slot);

    int n_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_;
    // High 32 bits: region generation; bit 31: region closed; low bits: workers inside it.
    std::atomic<uint64_t> state_{0};
    std::atomic<int64_t> next_chunk_{0};
    std::atomic<int64_t> done_chunks_{0};
    std::atomic<bool> stop_{false};
    int64_t n_chunks_ = 0;
    Fn fn_ = nullptr;
    void* ctx_ = nullptr;
    std::mutex run_mu_;  // one region at a time
};

}  // namespace evn
