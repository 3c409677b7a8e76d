# Copyright (c) 2026 BAAI. All rights reserved.
