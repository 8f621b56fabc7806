#include "common/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>

namespace kvferry {
namespace {

bool PortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range), where it picks
// ports for outgoing connections and binds to port 0.
int EphemeralLow() {
  std::FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  int low = 32768;
  int high = 60999;
  if (f != nullptr) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  return low;
}

}  // namespace

int FreeLoopbackPorts(int count, std::vector<int>& taken) {
  // Below the ephemeral range: a port found free here is not then taken by the kernel for some
  // other test's outgoing connection or port-0 bind before the caller binds it. Random bases
  // spread concurrent callers (parallel tests) over the range.
  constexpr int kLowest = 10000;
  const int span = std::max(EphemeralLow() - kLowest - count, 1000);
  std::random_device seed;
  std::mt19937 rng(seed());
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int base = kLowest + static_cast<int>(rng() % static_cast<unsigned>(span));
    bool ok = true;
    for (int i = 0; i < count && ok; ++i) {
      ok = std::find(taken.begin(), taken.end(), base + i) == taken.end() && PortFree(base + i);
    }
    if (ok) {
      for (int i = 0; i < count; ++i) taken.push_back(base + i);
      return base;
    }
  }
  return 0;
}

int FreeLoopbackPorts(int count) {
  std::vector<int> taken;
  return FreeLoopbackPorts(count, taken);
}

}  // namespace kvferry
