// Opens every file named on the command line with the GGUF reader and reads every tensor's
// bytes: each must load or be refused with GGUFError, never crash. Built with ASan + UBSan by
// test/test_native.py and run over a corpus of hostile files. Prints "N passed, M failed"
// (passed = handled: loaded or cleanly refused).
#include <cstdio>

#include "../gguf.h"

int main(int argc, char** argv) {
    int loaded = 0, refused = 0;
    for (int i = 1; i < argc; ++i) {
        try {
            evn::GGUFFile f(argv[i]);
            unsigned long sum = 0;
            for (const evn::TensorInfo& t : f.tensors()) {
                const unsigned char* p = static_cast<const unsigned char*>(t.data);
                for (unsigned long b = 0; b < t.nbytes; b += 4096) sum += p[b];
                if (t.nbytes) sum += p[t.nbytes - 1];
            }
            for (const auto& kv : f.metadata()) sum += kv.first.size();
            ++loaded;
            if (sum == 42) std::printf(" ");  // keep the reads
        } catch (const evn::GGUFError&) {
            ++refused;
        }
    }
    std::printf("loaded %d, refused %d\n", loaded, refused);
    std::printf("%d passed, 0 failed\n", loaded + refused);
    return 0;
}
