// The kernel microbenchmarks' clock (elementwise_bench.cpp, norms_bench.cpp): this thread's CPU
// time, so time the thread spends descheduled on a shared machine does not count.
#pragma once
#include <ctime>

inline double cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
