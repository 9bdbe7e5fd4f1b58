// The nn API in one include: Module and seeded init, layers, losses, optimizers and schedules,
// mixed precision, the model zoo, gradient checking and checkpoints.
#pragma once

#include "nn/amp.hpp"
#include "nn/autograd.hpp"
#include "nn/checkpoint.hpp"
#include "nn/clip.hpp"
#include "nn/gradcheck.hpp"
#include "nn/init.hpp"
#include "nn/layers.hpp"
#include "nn/loss.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"
#include "nn/param_groups.hpp"
#include "nn/profile.hpp"
#include "nn/zoo.hpp"
