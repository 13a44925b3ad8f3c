"""meshnode.stage"""
