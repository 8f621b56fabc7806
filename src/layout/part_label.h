// How errors about one part of one layer name it, shared by the checks of the spec
// (cache_spec.cc) and of its addresses (cache_addresses.cc).
#pragma once

#include <string>

#include "kvferry/cache_spec.h"

namespace kvferry {

/// "layer L part P ('name')".
inline std::string PartLabel(int layer, int part, const PartSpec& spec) {
  return "layer " + std::to_string(layer) + " part " + std::to_string(part) + " ('" + spec.name +
         "')";
}

}  // namespace kvferry
