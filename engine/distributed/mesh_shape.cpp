// Resolving a declared mesh shape against the world size.
#include "distributed/mesh_shape.h"

#include "core/error.h"

#include <cstdint>
#include <string>

namespace fsdpp {

MeshShape resolve_mesh(MeshShape declared, int world) {
  if (declared.replicate < 1) {
    throw UserError("mesh replicate " + std::to_string(declared.replicate) + " must be at least 1");
  }
  if (declared.shard == -1) {
    if (world % declared.replicate != 0) {
      throw UserError("mesh: world " + std::to_string(world) + " is not divisible by replicate " +
                      std::to_string(declared.replicate) + " (shard = -1 takes world / replicate)");
    }
    declared.shard = world / declared.replicate;
  }
  // In 64 bits: two int sizes near 2^31 multiply to 1 in 32.
  if (declared.shard < 1 || int64_t{declared.replicate} * declared.shard != world) {
    throw UserError("mesh replicate " + std::to_string(declared.replicate) + " × shard " +
                    std::to_string(declared.shard) + " ≠ world " + std::to_string(world));
  }
  return declared;
}

}  // namespace fsdpp
