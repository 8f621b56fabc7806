#include "common/ports.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace

int FreeLoopbackPorts(int count, std::vector<int>& taken) {
  // Random bases spread concurrent callers (parallel tests) over the range.
  std::random_device seed;
  std::mt19937 rng(seed());
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int base = 20000 + static_cast<int>(rng() % 40000u);
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
