// Idle-priority spinning threads that keep CPUs from going idle between
// steps (worker/idle_poll.py says why). Each thread is pinned to one CPU and
// runs under SCHED_IDLE, so any other runnable thread on that CPU preempts it
// at once; it only fills time the CPU would otherwise spend halted.
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

// One flag per start: a stop ends the threads of that start, and each thread
// holds a share of its flag, so it never outlives it.
std::mutex g_mutex;
std::shared_ptr<std::atomic<bool>> g_stop;
int64_t g_running = 0;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Pins this thread to ``cpu`` and drops it to SCHED_IDLE: "" or why not. It
// spins only once both hold; a thread that would spin at normal priority exits.
std::string become_idle_spinner(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set))
    return std::string("pthread_setaffinity_np: ") + std::strerror(rc);
  sched_param param{};
  param.sched_priority = 0;
  if (int rc = pthread_setschedparam(pthread_self(), SCHED_IDLE, &param))
    return std::string("pthread_setschedparam(SCHED_IDLE): ") + std::strerror(rc);
  return "";
}

void stop_locked() {
  if (g_stop) g_stop->store(true);
  g_stop.reset();
  g_running = 0;
}

// Starts one spinning thread per CPU in ``cpus`` (after stopping any running
// ones); returns how many run. Raises, with none left running, if any cannot.
int64_t start_idle_poll(std::vector<int64_t> cpus) {
  std::lock_guard<std::mutex> lock(g_mutex);
  stop_locked();
  auto stop = std::make_shared<std::atomic<bool>>(false);
  g_stop = stop;
  for (int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "start_idle_poll: no CPU ", cpu);
    std::promise<std::string> ready;
    std::future<std::string> why = ready.get_future();
    std::thread([cpu, stop, ready = std::move(ready)]() mutable {
      std::string problem = become_idle_spinner(static_cast<int>(cpu));
      bool ok = problem.empty();
      ready.set_value(std::move(problem));
      if (ok)
        while (!stop->load(std::memory_order_relaxed)) relax();
    }).detach();
    std::string problem = why.get();
    if (!problem.empty()) {
      stop_locked();
      TORCH_CHECK(false, "start_idle_poll: CPU ", cpu, ": ", problem);
    }
    ++g_running;
  }
  return g_running;
}

// Stops the running threads (each exits within one spin); returns how many ran.
int64_t stop_idle_poll() {
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t n = g_running;
  stop_locked();
  return n;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenbudget_cpu, m) {
  m.def("start_idle_poll(int[] cpus) -> int", &start_idle_poll);
  m.def("stop_idle_poll() -> int", &stop_idle_poll);
}
