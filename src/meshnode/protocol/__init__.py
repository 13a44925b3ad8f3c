"""meshnode.protocol"""
