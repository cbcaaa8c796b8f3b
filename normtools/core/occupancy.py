"""The occupancy query: how many thread-block clusters of a compiled kernel a GPU holds at once.

A cluster's CTAs run on the SMs of one GPC (14-18 SMs each on an H100/H200), so a GPU of S SMs
may hold fewer than S // num_ctas clusters of ``num_ctas`` CTAs. ``max_active_clusters`` asks
the driver (``cuOccupancyMaxActiveClusters``, cuda.h) through ctypes, with the kernel's real
block (num_warps × 32 threads) and dynamic shared memory: Triton's own helper assumes 128
threads. ``resident_clusters`` asks it for a kernel compiled by Triton (its metadata gives the
CTAs, warps and shared memory). The launcher (``launcher.plan_for``) sizes cluster grids from
it; ``normtools.measure.cluster_check`` reports it for every compiled cluster kernel.
"""

import ctypes

# cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config)
# from the driver API (cuda.h): the structures below mirror CUlaunchConfig and CUlaunchAttribute
# (tests/core/test_occupancy.py checks them against gcc's layout of Triton's cuda.h).
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (clusterDim's x, y,
    z at its start)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("cluster_x", ctypes.c_uint), ("cluster_y", ctypes.c_uint),
                ("cluster_z", ctypes.c_uint), ("value_rest", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def max_active_clusters(function, num_ctas, num_warps, shared):
    """Clusters of ``num_ctas`` CTAs of ``num_warps`` warps and ``shared`` bytes of dynamic
    shared memory of the loaded kernel ``function`` (a CUfunction handle) that the current GPU
    holds at once: cuOccupancyMaxActiveClusters. Raises OSError without libcuda, RuntimeError
    when the driver returns an error."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(function)
    for attribute, value in ((CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                             (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)):
        status = libcuda.cuFuncSetAttribute(handle, ctypes.c_int(attribute), ctypes.c_int(value))
        if status != 0:
            raise RuntimeError(f"cuFuncSetAttribute({attribute}) returned CUresult {status}")
    attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, cluster_x=num_ctas,
                                cluster_y=1, cluster_z=1)
    config = LaunchConfig(gridDimX=num_ctas, gridDimY=1, gridDimZ=1, blockDimX=32 * num_warps,
                          blockDimY=1, blockDimZ=1, sharedMemBytes=shared, hStream=None,
                          attrs=ctypes.pointer(attribute), numAttrs=1)
    clusters = ctypes.c_int(-1)
    status = libcuda.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), handle,
                                                  ctypes.byref(config))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters returned CUresult {status}")
    return clusters.value


def resident_clusters(compiled):
    """``max_active_clusters`` for a kernel compiled by Triton (``compiled``, what a launch of
    a ``@triton.jit`` kernel returns): its CTAs per cluster, warps and shared memory from its
    metadata, on the current GPU."""
    compiled._init_handles()
    metadata = compiled.metadata
    return max_active_clusters(compiled.function, metadata.num_ctas, metadata.num_warps,
                               metadata.shared)
