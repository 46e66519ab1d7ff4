"""Tests run on 8 fake CPU devices so that sharding is exercised everywhere."""
import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The tests' models are tiny: compiling them costs more than running them, so XLA skips LLVM's
# expensive passes (about a quarter of the suite's CPU time). HLO passes (fusion, sharding) still run.
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
