// strerror without its thread-safety problem.
#pragma once

#include <string.h>  // NOLINT(modernize-deprecated-headers): strerror_r is POSIX, not in <cstring>

#include <string>

namespace kvferry {

/// The text of an errno value, e.g. "Connection refused". Thread-safe (strerror_r).
inline std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r returns the message, which may or may not be `buf`.
  return ::strerror_r(err, buf, sizeof(buf));
}

}  // namespace kvferry
