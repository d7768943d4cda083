// The threads the fused step splits its work over: the calling thread and persistent workers, one per extra thread
// torch used when the kernels loaded.
//
// Our kernels run ~150 parallel regions per token, a few tens of microseconds each. OpenMP keeps a separate team per
// calling thread, and a team started from a thread OpenMP did not create (a server's engine thread) ran the same
// decode step 2.4x slower than the main thread's team on a 2-core machine; this pool behaves the same from any
// thread. Between regions its workers spin briefly (a token's regions come back to back), then sleep until woken.
// One region runs at a time; a region started from inside another (or while one runs) runs on its caller alone.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include <pthread.h>

namespace specsample {

class Pool {
 public:
  // made once (by `start`, else with torch's thread count at first use), never destroyed: its workers live as long
  // as the process
  static Pool& start(int threads) {
    static Pool* pool = new Pool(std::max(0, threads - 1));
    return *pool;
  }
  static Pool& get() { return start(at::get_num_threads()); }

  // f(chunk_begin, chunk_end) over [begin, end) split into contiguous chunks of at least `grain` items, PIECES per
  // participating thread, which the threads take in turn as they come free: a thread the OS preempts (a server's
  // event loop sharing the cores) delays the region by a chunk, not by a whole share
  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t range = end - begin;
    if (range <= 0) return;
    const int64_t most = (range + grain - 1) / std::max<int64_t>(grain, 1);
    const int64_t wanted = std::min<int64_t>(workers_ + 1, most);
    std::unique_lock<std::mutex> region(dispatch_, std::try_to_lock);
    if (wanted <= 1 || inside_ || !region.owns_lock() || forked()) {
      f(begin, end);
      return;
    }
    const int64_t pieces = std::min<int64_t>(most, wanted * PIECES), step = (range + pieces - 1) / pieces;
    next_.store(0, std::memory_order_relaxed);
    task_ = [&, step, pieces](int64_t) {
      for (int64_t piece = next_.fetch_add(1, std::memory_order_relaxed); piece < pieces;
           piece = next_.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t lo = begin + piece * step, hi = std::min(end, lo + step);
        if (lo < hi) f(lo, hi);
      }
    };
    participants_ = wanted;
    pending_.store(static_cast<int>(wanted - 1), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    inside_ = true;
    std::exception_ptr error;
    try {
      task_(0);
    } catch (...) {
      error = std::current_exception();
    }
    inside_ = false;
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
    if (!error) error = worker_error_;
    worker_error_ = nullptr;
    if (error) std::rethrow_exception(error);
  }

 private:
  static constexpr int64_t PIECES = 4;  // chunks per participating thread
  static constexpr int SPIN = 2000;  // pauses (~10 us) a worker waits for the next region before sleeping

  explicit Pool(int workers) : workers_(workers) {
    for (int i = 0; i < workers; ++i) std::thread([this, i] { work(i + 1); }).detach();
    pthread_atfork(nullptr, nullptr, [] { forked() = true; });  // a forked child has no workers: it runs alone
  }

  static bool& forked() {
    static bool value = false;
    return value;
  }

  void work(int64_t part) {
    uint64_t seen = 0;
    for (;;) {
      for (int i = 0; i < SPIN && generation_.load(std::memory_order_acquire) == seen; ++i) _mm_pause();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (part < participants_) {
        inside_ = true;
        try {
          task_(part);
        } catch (...) {
          std::lock_guard<std::mutex> lock(sleep_mutex_);
          worker_error_ = std::current_exception();
        }
        inside_ = false;
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  int64_t workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int64_t> next_{0};  // the next chunk to take
  std::function<void(int64_t)> task_;
  int64_t participants_ = 0;
  std::exception_ptr worker_error_;
  std::mutex dispatch_, sleep_mutex_;
  std::condition_variable wake_;
  static inline thread_local bool inside_ = false;
};

// at::parallel_for's contract on our pool
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool::get().run(begin, end, grain, f);
}

}  // namespace specsample
