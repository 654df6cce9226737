// A 1-D or 2-D (replicate × shard) arrangement of the world's ranks. Parameters are sharded
// across the shard group (ranks r·S .. r·S + S-1) and replicated across the replicate
// group (ranks s, S + s, 2S + s, ...): replicate = 1 is plain FSDP, replicate > 1 is HSDP.
#pragma once

#include "distributed/comm.h"
#include "distributed/mesh_shape.h"

#include <memory>

namespace fsdpp {

struct DeviceMesh {
  int replicate = 1;
  int shard = 1;
  std::shared_ptr<Comm> world;
  std::shared_ptr<Comm> shard_group;
  std::shared_ptr<Comm> replicate_group;

  // The k consecutive ranks of this rank's shard group that gather a unit in backward when
  // it keeps 1/k of its parameters after forward (reshard_after_forward = k).
  std::shared_ptr<Comm> post_forward_group(int k) const;

  // The groups of `declared` as resolve_mesh resolves it for the world (a UserError when it
  // does not fit).
  static DeviceMesh create(std::shared_ptr<Comm> world, MeshShape declared);
};

}  // namespace fsdpp
