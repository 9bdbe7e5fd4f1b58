// Every built-in layer.
#pragma once

#include "nn/activations.hpp"
#include "nn/attention.hpp"
#include "nn/containers.hpp"
#include "nn/conv.hpp"
#include "nn/dropout.hpp"
#include "nn/embedding.hpp"
#include "nn/linear.hpp"
#include "nn/norm.hpp"
#include "nn/pooling.hpp"
