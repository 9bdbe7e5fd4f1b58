// Model zoo: ready-made networks, returned unmaterialised (call materialize(device, seed)).
#pragma once

#include <memory>
#include <vector>

#include "nn/gpt.hpp"
#include "nn/layers.hpp"
#include "nn/llama.hpp"

namespace nn {

// Flatten, then Linear layers of the given sizes with ReLU between them:
// mlp({784, 256, 10}) = Flatten, Linear(784, 256), ReLU, Linear(256, 10).
// requires at least two sizes, all > 0.
inline std::shared_ptr<Sequential> mlp(const std::vector<int64_t>& sizes) {
  DP_CHECK(sizes.size() >= 2, "mlp: needs at least {in, out}, got " << sizes.size() << " sizes");
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Flatten>());
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    if (i > 0) net->add(std::make_shared<ReLU>());
    net->add(std::make_shared<Linear>(sizes[i], sizes[i + 1]));
  }
  return net;
}

// LeNet-5 style: (conv5x5 - ReLU - maxpool2) x 2, then Linear 120 - ReLU - 84 - ReLU - classes.
// The first conv pads by 2, so a 28x28 input (MNIST) gives the classic 16x5x5 features; a 32x32
// input gives 16x6x6. x (N, in_channels, image_size, image_size) -> (N, classes).
inline std::shared_ptr<Sequential> lenet(int64_t in_channels, int64_t classes,
                                         int64_t image_size = 28) {
  DP_CHECK(image_size >= 12, "lenet: image_size " << image_size << " is too small");
  const int64_t s = ((image_size / 2) - 4) / 2;  // spatial size after the second pool
  return sequential({
      std::make_shared<Conv2d>(in_channels, 6, 5, 1, 2),
      std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2),  // (N, 6, H/2, W/2)
      std::make_shared<Conv2d>(6, 16, 5),
      std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2),  // (N, 16, s, s)
      std::make_shared<Flatten>(),     // (N, 16 s s)
      std::make_shared<Linear>(16 * s * s, 120),
      std::make_shared<ReLU>(),
      std::make_shared<Linear>(120, 84),
      std::make_shared<ReLU>(),
      std::make_shared<Linear>(84, classes),
  });
}

// CIFAR-style ResNet BasicBlock: conv3x3-BN-ReLU-conv3x3-BN plus the skip (1x1 conv + BN when
// the shape changes), then ReLU. (N, in, H, W) -> (N, out, H/stride, W/stride).
inline std::shared_ptr<Sequential> basic_block(int64_t in, int64_t out, int stride) {
  auto body = sequential({
      std::make_shared<Conv2d>(in, out, 3, stride, 1, Bias::no),
      std::make_shared<BatchNorm2d>(out),
      std::make_shared<ReLU>(),
      std::make_shared<Conv2d>(out, out, 3, 1, 1, Bias::no),
      std::make_shared<BatchNorm2d>(out),
  });
  ModulePtr shortcut;
  if (stride != 1 || in != out)
    shortcut = sequential({std::make_shared<Conv2d>(in, out, 1, stride, 0, Bias::no),
                           std::make_shared<BatchNorm2d>(out)});
  return sequential({std::make_shared<Residual>(body, shortcut), std::make_shared<ReLU>()});
}

// ResNet for 28x28 or 32x32 images (He et al. 2016, section 4.2): depth = 6n + 2 (8, 20, 32,
// ...). Stem conv3x3(width)-BN-ReLU; three stages of n BasicBlocks with width, 2 width, 4 width
// channels (the last two halve the resolution); GlobalAvgPool; Linear(4 width, classes).
inline std::shared_ptr<Sequential> resnet(int depth, int64_t in_channels, int64_t classes,
                                          int64_t width = 16) {
  DP_CHECK(depth >= 8 && (depth - 2) % 6 == 0,
           "resnet: depth " << depth << " must be 6n + 2 with n >= 1 (8, 20, 32, ...)");
  const int blocks = (depth - 2) / 6;
  auto net = sequential({std::make_shared<Conv2d>(in_channels, width, 3, 1, 1, Bias::no),
                         std::make_shared<BatchNorm2d>(width), std::make_shared<ReLU>()});
  int64_t channels = width;
  for (int stage = 0; stage < 3; ++stage) {
    const int64_t out = width << stage;
    for (int b = 0; b < blocks; ++b) {
      const int stride = (stage > 0 && b == 0) ? 2 : 1;
      net->add(basic_block(channels, out, stride));
      channels = out;
    }
  }
  net->add(std::make_shared<GlobalAvgPool>());  // (N, 4 width)
  net->add(std::make_shared<Linear>(channels, classes));
  return net;
}

// A GPT-2 model (nn/gpt.hpp): ids (B, T) i32 -> logits (B, T, vocab).
//   nn::gpt(nn::GptConfig::preset("124m"))
inline std::shared_ptr<Gpt> gpt(const GptConfig& config) {
  return std::make_shared<Gpt>(config);
}

// A Llama-style model (nn/llama.hpp: RMSNorm, SwiGLU, rotary attention, untied head):
// ids (B, T) i32 -> logits (B, T, vocab).
//   nn::llama(nn::LlamaConfig::preset("tiny"))
inline std::shared_ptr<Llama> llama(const LlamaConfig& config) {
  return std::make_shared<Llama>(config);
}

}  // namespace nn
