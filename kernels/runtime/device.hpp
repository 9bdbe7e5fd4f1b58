// Devices: `cpu:i` or `cuda:i`. Indices are logical: N logical CUDA devices map round-robin
// onto the physical GPUs, and N CPU devices each get their own memory and task arena.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace kernels {

enum class DeviceType { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu(int i = 0) { return {DeviceType::cpu, i}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  // Parses "cpu", "cpu:2", "cuda", "cuda:1". Throws kernels::Error naming the text otherwise.
  static Device parse(const std::string& text);

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string str() const;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const { return type != o.type ? type < o.type : index < o.index; }
};

inline std::ostream& operator<<(std::ostream& os, const Device& d) {
  return os << d.str();
}

// Number of physical CUDA GPUs usable by this process: 0 when the build has no CUDA backend,
// no driver is installed or no GPU is visible. Detected once, at first call.
int cuda_device_count();
// Why cuda_device_count() is 0 (empty when it is not): "built without CUDA", the driver's error...
std::string cuda_unavailable_reason();
// True when the build compiled the CUDA backend (whether or not a GPU is present).
bool built_with_cuda();

// The name of physical GPU `physical` ("NVIDIA H100 80GB HBM3"), or "none" without one.
std::string gpu_name(int physical);

// The device type a `--device` flag names: "cpu"; "cuda" (throws with the reason when no GPU is
// usable); "auto": cuda when a GPU is usable, else cpu, and then, if `fallback` is given, it
// receives one line saying why. Throws naming any other text.
DeviceType choose_device_type(const std::string& flag, std::string* fallback = nullptr);

// The physical GPU that logical device cuda:i runs on (round-robin). Throws if no GPU.
int physical_gpu(const Device& d);

// Parses a device list: "cpu:0,cpu:1", or a count with a type ("4" with a default type).
// `make_devices(DeviceType::cuda, 4)` gives cuda:0..3.
std::vector<Device> make_devices(DeviceType type, int n);

}  // namespace kernels
