// Building the mesh's sub-groups; each process creates only the two groups it is in.
#include "distributed/device_mesh.h"

#include "core/error.h"

#include <string>
#include <vector>

namespace fsdpp {

DeviceMesh DeviceMesh::create(std::shared_ptr<Comm> world, MeshShape declared) {
  const auto [replicate, shard] = resolve_mesh(declared, world->size());
  DeviceMesh mesh;
  mesh.replicate = replicate;
  mesh.shard = shard;
  const int row = world->rank() / shard, column = world->rank() % shard;
  if (replicate == 1) {
    mesh.shard_group = world;
    mesh.replicate_group = Comm::single();
  } else {
    std::vector<int> shard_ranks, replicate_ranks;
    for (int j = 0; j < shard; ++j) shard_ranks.push_back(row * shard + j);
    for (int i = 0; i < replicate; ++i) replicate_ranks.push_back(i * shard + column);
    // Every process builds its shard group first, so the group rendezvous pair up.
    // Tags carry the shape, so meshes of different shapes never share rendezvous keys.
    const std::string shape = std::to_string(replicate) + "x" + std::to_string(shard);
    mesh.shard_group = world->subgroup(shard_ranks, "shard-" + shape + "/" + std::to_string(row));
    mesh.replicate_group = world->subgroup(replicate_ranks, "replicate-" + shape + "/" + std::to_string(column));
  }
  mesh.world = std::move(world);
  return mesh;
}

std::shared_ptr<Comm> DeviceMesh::post_forward_group(int k) const {
  TORCH_CHECK(k > 0 && shard % k == 0, "post-forward group of ", k, " ranks does not divide shard ", shard);
  const int row = world->rank() / shard, position = world->rank() % shard, block = position / k;
  std::vector<int> ranks;
  for (int i = 0; i < k; ++i) ranks.push_back(row * shard + block * k + i);
  return world->subgroup(ranks, "post-forward-" + std::to_string(replicate) + "x" + std::to_string(shard) + "-k" +
                                    std::to_string(k) + "/" + std::to_string(row) + "/" + std::to_string(block));
}

}  // namespace fsdpp
