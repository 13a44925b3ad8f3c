"""meshnode.compression"""
