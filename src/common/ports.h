// Free TCP ports on the loopback, for tools and tests that start listeners of their own.
#pragma once

#include <vector>

namespace kvferry {

/// The first of `count` consecutive ports that could be bound on 127.0.0.1 a moment ago and are
/// not in `taken` (they are added to it); 0 when none was found. Another process may still take
/// a port before the caller binds it: callers that can retry should.
int FreeLoopbackPorts(int count, std::vector<int>& taken);
int FreeLoopbackPorts(int count);

}  // namespace kvferry
